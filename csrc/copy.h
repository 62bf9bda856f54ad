// Host memory copies on native threads: the CPU side of the snapshot, issued now and waited for later.
// The protocol is the CUDA one: a copy is issued into a batch (one batch per staging slot), the batch records
// its completion, and the writer waits on it before it reads the slot. No Python, no GIL.
// The same threads checksum what they copied once it landed (`checksum`): one engine thread touches the bytes
// after another, instead of a second thread reading them beside training. A thread takes a queued copy before
// any checksum. A thread that waits for the copies may run queued ones itself (`run_copies`): the fence's caller,
// blocked there, lends its core.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace ds {

// Pieces of at most this size, so that one large copy keeps every thread busy.
constexpr uint64_t kCopyPiece = 4u << 20;

// The completion of a group of copies: done once every piece queued into it has landed.
class CopyBatch {
 public:
  void wait();
  bool done();

 private:
  friend class CopyPool;
  void add(uint64_t n);
  void finish_one();

  std::mutex mu_;
  std::condition_variable cv_;
  uint64_t remaining_ = 0;
};

// The crc32c of each range of a checksum request, once the copy threads have computed them all.
class Checksums {
 public:
  std::vector<uint32_t> wait();

 private:
  friend class CopyPool;
  struct Part {  // one piece of one range
    uint64_t range, index;
    const char* p;
    uint64_t n;
  };
  void finish_part(const Part& part, uint32_t crc);

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::vector<uint32_t>> partial_;  // per range, the crc of each of its pieces
  std::vector<uint64_t> last_len_;              // per range, the length of its last piece
  std::vector<uint32_t> crcs_;
  uint64_t remaining_ = 0;
};

class CopyPool {
 public:
  explicit CopyPool(int threads);
  ~CopyPool();
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  // Queues memcpy(dst, src, n) into `batch`; both ranges must stay valid until the batch is done.
  void copy(const std::shared_ptr<CopyBatch>& batch, uintptr_t dst, uintptr_t src, uint64_t n);
  // Queues the crc32c of each (start, length) range of the memory at `ptr`, to run once `after` (may be null) is
  // done; every copy of `after` must be queued already. The memory must stay valid until the result is waited.
  std::shared_ptr<Checksums> checksum(const std::shared_ptr<CopyBatch>& after, uintptr_t ptr,
                                      const std::vector<std::pair<uint64_t, uint64_t>>& ranges);
  // Runs queued copies on the calling thread until none is queued, and how many pieces it ran. Never a checksum:
  // those are the writers' side, and one may wait for copies. With the caller's own core beside the pool's threads,
  // a caller that would only wait for the copies (training, blocked at the fence) makes them land sooner.
  uint64_t run_copies();
  // Whether a copy is queued that no thread has taken yet.
  bool copies_queued();
  // Finishes queued copies, then joins the threads. Idempotent.
  void close();

 private:
  struct Piece {  // a copy (batch set) or a piece of a checksum (sums set)
    std::shared_ptr<CopyBatch> batch;
    char* dst;
    const char* src;
    uint64_t n;
    std::shared_ptr<Checksums> sums;
    std::shared_ptr<CopyBatch> after;
    Checksums::Part part;
  };
  void worker();
  static void run_copy(const Piece& p);

  std::mutex mu_;
  std::condition_variable cv_;
  // Copies go before checksums: the fence waits for the copies only, and a checksum queued behind a slot's
  // copies must not hold up the next slot's; the checksums fill the time the copies leave.
  std::deque<Piece> copies_, sums_;
  bool stopping_ = false;
  std::mutex close_mu_;
  std::vector<std::thread> threads_;
};

}  // namespace ds
