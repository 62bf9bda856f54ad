// Files and the worker pool that moves staging buffers to and from disk without the GIL.
// Nothing here touches Python: workers are plain threads, errors are OsError values.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <shared_mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace ds {

// O_DIRECT wants buffer address, length and file offset to be multiples of this.
constexpr uint64_t kAlign = 4096;
// The pool splits larger requests into pieces of at most this size, so one big buffer uses every worker.
constexpr uint64_t kChunk = 8u << 20;
// A write from an unaligned address goes direct through a copy in a per-thread aligned buffer of this size.
constexpr uint64_t kBounce = 2u << 20;

// An operating-system failure; the bindings raise it as OSError(err, msg).
struct OsError : std::exception {
  int err;
  std::string msg;
  OsError(int err, std::string msg) : err(err), msg(std::move(msg)) {}
  const char* what() const noexcept override { return msg.c_str(); }
};

// "<what> '<path>': <strerror(err)>"
std::string errno_message(const std::string& what, const std::string& path, int err);

class File {
 public:
  // mode "w" (create/truncate, 0644) or "r"; direct "auto", "on" or "off" (see the module docstring).
  // A `stream` file is read (or written) as one sequential stream: a pool serves its requests one at a time
  // in submission order, and drops the pages of each buffered read from the page cache behind it.
  File(std::string path, const std::string& mode, const std::string& direct, uint64_t preallocate,
       bool stream = false);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const { return path_; }
  bool direct() const { return direct_.load(); }
  bool stream() const { return stream_; }
  uint64_t size();
  void fsync();
  void truncate(uint64_t n);
  void close();

  // pwrite (write) or pread `len` bytes between `p` and file offset `off`, retrying short transfers and EINTR.
  // Aligned stretches go through the O_DIRECT descriptor when allow_direct, the rest through the buffered one;
  // a write's aligned stretch at an unaligned address goes direct through a per-thread aligned copy.
  // Returns 0 or an errno; `done` receives the bytes moved (less than len without error only at EOF on read).
  int transfer(bool write, char* p, uint64_t len, uint64_t off, bool allow_direct, uint64_t& done);
  // Best effort: forget the cached pages of [off, off + len), so that a stream read leaves no trace in memory.
  void drop_cache(uint64_t off, uint64_t len);

 private:
  enum class DirectMode { Auto, On, Off };

  std::string path_;
  DirectMode mode_;
  bool stream_;
  int fd_ = -1;   // buffered descriptor: unaligned I/O, fsync, fstat, ftruncate
  int dfd_ = -1;  // O_DIRECT descriptor, -1 when not in use
  std::atomic<bool> direct_{false};  // O_DIRECT in use
  std::atomic<bool> direct_proven_{false};  // an O_DIRECT transfer has succeeded on this file
  // Transfers hold it shared and close() exclusively, so descriptors are never closed (and their numbers
  // reused) under an in-flight pread/pwrite.
  std::shared_mutex lifetime_;
};

class IOPool {
 public:
  using Segment = std::pair<uint64_t, uint64_t>;  // (start relative to ptr, length)

  // `nice` > 0 lowers the workers' scheduling priority (Linux per-thread nice): checksums and writes of a
  // background flush then yield the CPU to training and to the snapshot copies, which are on the critical path.
  explicit IOPool(int threads, int nice = 0);
  ~IOPool();
  IOPool(const IOPool&) = delete;
  IOPool& operator=(const IOPool&) = delete;

  // Queues a write (crc of each segment, then pwrite) or a read (pread, then crc of each segment) of the
  // memory [ptr, ptr + nbytes), which the caller keeps alive until the ticket is waited. Returns the ticket.
  uint64_t submit(bool write, std::shared_ptr<File> file, uintptr_t ptr, uint64_t nbytes, uint64_t offset,
                  std::vector<Segment> segments);
  // Blocks until the ticket is done; returns its segment crcs or throws its OsError. Forgets the ticket.
  std::vector<uint32_t> wait(uint64_t ticket);
  // Blocks until every ticket not yet waited is done, forgets them all, and throws the first one's error.
  void wait_all();
  // Finishes queued work, then joins the workers. Idempotent.
  void close();

  uint64_t bytes_written() const { return bytes_written_.load(); }
  uint64_t bytes_read() const { return bytes_read_.load(); }
  uint64_t writes() const { return writes_.load(); }
  uint64_t reads() const { return reads_.load(); }

 private:
  struct Ticket;
  struct Chunk {
    std::shared_ptr<Ticket> ticket;
    uint64_t index;  // chunk number within the request: it covers [index * kChunk, ...) of the buffer
    uint64_t start, len;
  };

  void worker(int nice);
  // The oldest queued chunk a worker may take now: any but those of a stream file already being transferred.
  std::deque<Chunk>::iterator next_chunk();
  void run_chunk(const Chunk& c);
  void finish(Ticket& t);

  std::mutex mu_;  // guards everything below up to the counters
  std::condition_variable work_cv_, done_cv_;
  std::deque<Chunk> queue_;
  std::set<const File*> streaming_;  // stream files with a chunk being transferred
  std::map<uint64_t, std::shared_ptr<Ticket>> tickets_;  // submitted, not yet waited (ordered by ticket)
  uint64_t next_ticket_ = 1;
  bool stopping_ = false;

  std::mutex close_mu_;  // serialises close() callers
  std::vector<std::thread> threads_;

  std::atomic<uint64_t> bytes_written_{0}, bytes_read_{0}, writes_{0}, reads_{0};
};

}  // namespace ds
