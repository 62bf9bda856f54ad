// Host memory copies on native threads: the CPU side of the snapshot, issued now and waited for later.
// The protocol is the CUDA one: a copy is issued into a batch (one batch per staging slot), the batch records
// its completion, and the writer waits on it before it reads the slot. No Python, no GIL.
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

class CopyPool {
 public:
  explicit CopyPool(int threads);
  ~CopyPool();
  CopyPool(const CopyPool&) = delete;
  CopyPool& operator=(const CopyPool&) = delete;

  // Queues memcpy(dst, src, n) into `batch`; both ranges must stay valid until the batch is done.
  void copy(const std::shared_ptr<CopyBatch>& batch, uintptr_t dst, uintptr_t src, uint64_t n);
  // Finishes queued copies, then joins the threads. Idempotent.
  void close();

 private:
  struct Piece {
    std::shared_ptr<CopyBatch> batch;
    char* dst;
    const char* src;
    uint64_t n;
  };
  void worker();

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Piece> queue_;
  bool stopping_ = false;
  std::mutex close_mu_;
  std::vector<std::thread> threads_;
};

}  // namespace ds
