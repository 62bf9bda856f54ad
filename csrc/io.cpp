#include "io.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "crc32c.h"

namespace ds {

std::string errno_message(const std::string& what, const std::string& path, int err) {
  return what + " '" + path + "': " + std::strerror(err);
}

// ---------------------------------------------------------------------------------------------- File

File::File(std::string path, const std::string& mode, const std::string& direct, uint64_t preallocate, bool stream)
    : path_(std::move(path)), stream_(stream) {
  if (mode != "w" && mode != "r") throw std::invalid_argument("File mode must be 'w' or 'r', not '" + mode + "'");
  if (direct == "auto") {
    mode_ = DirectMode::Auto;
  } else if (direct == "on") {
    mode_ = DirectMode::On;
  } else if (direct == "off") {
    mode_ = DirectMode::Off;
  } else {
    throw std::invalid_argument("File direct must be 'auto', 'on' or 'off', not '" + direct + "'");
  }
  const bool writing = mode == "w";
  if (preallocate && !writing) throw std::invalid_argument("preallocate needs mode 'w'");

  const std::string what = writing ? "open for writing" : "open for reading";
  const int access = (writing ? O_WRONLY : O_RDONLY) | O_CLOEXEC;
  fd_ = ::open(path_.c_str(), access | (writing ? O_CREAT | O_TRUNC : 0), 0644);
  if (fd_ < 0) throw OsError(errno, errno_message(what, path_, errno));

  if (mode_ != DirectMode::Off) {
    dfd_ = ::open(path_.c_str(), access | O_DIRECT);
    // EINVAL is how a file system without O_DIRECT support (tmpfs, some FUSE) answers; "auto" goes buffered.
    if (dfd_ < 0 && (mode_ == DirectMode::On || errno != EINVAL)) {
      const int err = errno;
      close();
      throw OsError(err, errno_message(what + " with O_DIRECT", path_, err));
    }
  }
  direct_ = dfd_ >= 0;

  if (preallocate) {
    // Reserve the blocks now so that a full disk fails here, before anything is staged.
    int rc;
    do {
      rc = ::fallocate(fd_, 0, 0, off_t(preallocate));
    } while (rc != 0 && errno == EINTR);
    if (rc != 0 && errno != EOPNOTSUPP) {
      const int err = errno;
      // Hand back any partial allocation (best effort: the preallocation error is what gets reported).
      [[maybe_unused]] const int ignored = ::ftruncate(fd_, 0);
      close();
      throw OsError(err, errno_message("preallocate " + std::to_string(preallocate) + " bytes for", path_, err));
    }
  }
}

File::~File() { close(); }

void File::close() {
  std::unique_lock lock(lifetime_);
  if (dfd_ >= 0) ::close(dfd_);
  if (fd_ >= 0) ::close(fd_);
  dfd_ = fd_ = -1;
  direct_ = false;
}

uint64_t File::size() {
  std::shared_lock lock(lifetime_);
  struct stat st;
  if (fd_ < 0) throw OsError(EBADF, errno_message("stat", path_, EBADF));
  if (::fstat(fd_, &st) != 0) throw OsError(errno, errno_message("stat", path_, errno));
  return uint64_t(st.st_size);
}

void File::fsync() {
  std::shared_lock lock(lifetime_);
  if (fd_ < 0) throw OsError(EBADF, errno_message("fsync", path_, EBADF));
  int rc;
  do {
    rc = ::fsync(fd_);  // flushes the inode, whichever of its descriptors wrote the data
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) throw OsError(errno, errno_message("fsync", path_, errno));
}

void File::truncate(uint64_t n) {
  std::shared_lock lock(lifetime_);
  if (fd_ < 0) throw OsError(EBADF, errno_message("truncate", path_, EBADF));
  int rc;
  do {
    rc = ::ftruncate(fd_, off_t(n));
  } while (rc != 0 && errno == EINTR);
  if (rc != 0) throw OsError(errno, errno_message("truncate", path_, errno));
}

// This thread's aligned buffer for the direct writes of bytes at unaligned addresses (allocated at first use).
static char* bounce_buffer() {
  static thread_local std::unique_ptr<char, decltype(&std::free)> buffer(nullptr, &std::free);
  if (!buffer) {
    void* p = nullptr;
    if (::posix_memalign(&p, kAlign, kBounce) != 0) return nullptr;
    buffer.reset(static_cast<char*>(p));
  }
  return buffer.get();
}

int File::transfer(bool write, char* p, uint64_t len, uint64_t off, bool allow_direct, uint64_t& done) {
  std::shared_lock lock(lifetime_);
  done = 0;
  if (fd_ < 0) return EBADF;
  while (done < len) {
    char* const q = p + done;
    const uint64_t pos = off + done;
    uint64_t n = len - done;
    bool use_direct = false;
    char* from = q;  // where the bytes are written from: q, or the bounce buffer holding a copy of them
    const uint64_t misalign = pos % kAlign;
    const uint64_t mem_misalign = reinterpret_cast<uintptr_t>(q) % kAlign;
    if (allow_direct && direct_.load()) {
      if (misalign) {
        // buffered up to the next boundary, so the rest can go direct
        if (misalign == mem_misalign || write) n = std::min(n, kAlign - misalign);
      } else if (n >= kAlign && (!mem_misalign || write)) {
        n -= n % kAlign;  // the aligned body; a tail shorter than a block follows buffered
        use_direct = true;
        if (mem_misalign) {  // a write from an unaligned address: its copy in an aligned buffer goes direct
          n = std::min(n, kBounce);
          from = bounce_buffer();
          if (from == nullptr) return ENOMEM;
          std::memcpy(from, q, n);
        }
      }
    }
    const int fd = use_direct ? dfd_ : fd_;
    const ssize_t r = write ? ::pwrite(fd, from, n, off_t(pos)) : ::pread(fd, q, n, off_t(pos));
    if (r < 0) {
      if (errno == EINTR) continue;
      // "auto": the file system accepted O_DIRECT at open() but refuses the I/O itself; go buffered for good.
      if (errno == EINVAL && use_direct && mode_ == DirectMode::Auto && !direct_proven_.load()) {
        direct_ = false;
        continue;
      }
      return errno;
    }
    if (r == 0) {
      if (write) return EIO;  // pwrite makes no progress only on a broken device
      break;                  // end of file: the caller reports the short read
    }
    if (use_direct) direct_proven_ = true;
    done += uint64_t(r);
  }
  return 0;
}

void File::drop_cache(uint64_t off, uint64_t len) {
  std::shared_lock lock(lifetime_);
  if (fd_ >= 0) (void)::posix_fadvise(fd_, off_t(off), off_t(len), POSIX_FADV_DONTNEED);
}

// -------------------------------------------------------------------------------------------- IOPool

struct IOPool::Ticket {
  bool write;
  std::shared_ptr<File> file;
  uintptr_t ptr;
  uint64_t nbytes, offset;
  std::vector<Segment> segments;
  // A segment spanning several chunks is checksummed piecewise (one piece per chunk, in chunk order) by
  // whichever workers run those chunks; the last worker combines the pieces.
  std::vector<uint64_t> first_piece;  // per segment, index of its first piece
  std::vector<uint32_t> pieces;
  std::vector<uint32_t> crcs;
  std::atomic<uint64_t> remaining{0};  // chunks not finished

  std::mutex err_mu;
  int err = 0;
  uint64_t err_at = 0;  // chunk start of the reported error: the lowest failing chunk wins
  std::string err_msg;

  bool done = false;  // guarded by IOPool::mu_
};

namespace {

uint64_t first_chunk(const IOPool::Segment& s) { return s.first / kChunk; }
uint64_t piece_count(const IOPool::Segment& s) {
  return s.second ? (s.first + s.second - 1) / kChunk - first_chunk(s) + 1 : 0;
}

}  // namespace

IOPool::IOPool(int threads, int nice) {
  if (threads < 1) throw std::invalid_argument("IOPool needs at least one thread");
  try {
    for (int i = 0; i < threads; i++) threads_.emplace_back(&IOPool::worker, this, nice);
  } catch (...) {
    close();
    throw;
  }
}

IOPool::~IOPool() { close(); }

void IOPool::close() {
  std::lock_guard closing(close_mu_);
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
}

uint64_t IOPool::submit(bool write, std::shared_ptr<File> file, uintptr_t ptr, uint64_t nbytes, uint64_t offset,
                        std::vector<Segment> segments) {
  if (!file) throw std::invalid_argument("file must be a File");
  if (nbytes && !ptr) throw std::invalid_argument("ptr is null");
  for (const auto& s : segments)
    if (s.first > nbytes || s.second > nbytes - s.first)
      throw std::invalid_argument("segment (" + std::to_string(s.first) + ", " + std::to_string(s.second) +
                                  ") is outside the " + std::to_string(nbytes) + "-byte request");

  auto t = std::make_shared<Ticket>();
  t->write = write;
  t->file = std::move(file);
  t->ptr = ptr;
  t->nbytes = nbytes;
  t->offset = offset;
  t->segments = std::move(segments);
  uint64_t npieces = 0;
  for (const auto& s : t->segments) {
    t->first_piece.push_back(npieces);
    npieces += piece_count(s);
  }
  t->pieces.assign(npieces, 0);
  const uint64_t nchunks = (nbytes + kChunk - 1) / kChunk;
  t->remaining = nchunks;

  uint64_t id;
  {
    std::lock_guard lock(mu_);
    if (stopping_) throw std::runtime_error("IOPool is closed");
    if (nchunks == 0) {  // nothing to move: every segment is empty
      t->crcs.assign(t->segments.size(), 0);
      t->done = true;
      (write ? writes_ : reads_)++;
    }
    id = next_ticket_++;
    tickets_.emplace(id, t);
    for (uint64_t k = 0; k < nchunks; k++)
      queue_.push_back(Chunk{t, k, k * kChunk, std::min(kChunk, nbytes - k * kChunk)});
  }
  work_cv_.notify_all();
  return id;
}

void IOPool::worker(int nice) {
  (void)::pthread_setname_np(::pthread_self(), "ds-io");  // seen by tools (top -H) and the priority test
  // Best effort: a thread's nice value only ever goes up without privileges, which is all this asks for.
  if (nice > 0) (void)::setpriority(PRIO_PROCESS, pid_t(::syscall(SYS_gettid)), ::getpriority(PRIO_PROCESS, 0) + nice);
  for (;;) {
    Chunk c;
    {
      std::unique_lock lock(mu_);
      auto next = queue_.end();
      work_cv_.wait(lock, [&] { return (next = next_chunk()) != queue_.end() || (stopping_ && queue_.empty()); });
      if (next == queue_.end()) return;  // stopping, and everything queued has been done
      c = std::move(*next);
      queue_.erase(next);
      if (c.ticket->file->stream()) streaming_.insert(c.ticket->file.get());
    }
    run_chunk(c);
    if (c.ticket->file->stream()) {
      {
        std::lock_guard lock(mu_);
        streaming_.erase(c.ticket->file.get());
      }
      work_cv_.notify_all();  // the stream's next chunk may wait for a worker
    }
  }
}

std::deque<IOPool::Chunk>::iterator IOPool::next_chunk() {
  for (auto it = queue_.begin(); it != queue_.end(); ++it)
    if (!it->ticket->file->stream() || !streaming_.count(it->ticket->file.get())) return it;
  return queue_.end();
}

void IOPool::run_chunk(const Chunk& c) {
  Ticket& t = *c.ticket;
  char* const base = reinterpret_cast<char*>(t.ptr);
  const uint64_t end = c.start + c.len;
  auto checksum = [&] {
    for (size_t i = 0; i < t.segments.size(); i++) {
      const Segment& s = t.segments[i];
      const uint64_t lo = std::max(s.first, c.start), hi = std::min(s.first + s.second, end);
      if (lo < hi) t.pieces[t.first_piece[i] + c.index - first_chunk(s)] = crc32c(0, base + lo, hi - lo);
    }
  };

  // Writes checksum before the pwrite (the bytes as submitted), reads after the pread (the bytes as read).
  if (t.write) checksum();
  uint64_t done = 0;
  int err = t.file->transfer(t.write, base + c.start, c.len, t.offset + c.start, true, done);
  (t.write ? bytes_written_ : bytes_read_) += done;
  std::string msg;
  if (err) {
    msg = std::string(t.write ? "pwrite '" : "pread '") + t.file->path() + "' at offset " +
          std::to_string(t.offset) + " (" + std::to_string(t.nbytes) + " bytes): " + std::strerror(err);
  } else if (done < c.len) {
    err = ENODATA;
    msg = "short read '" + t.file->path() + "': wanted " + std::to_string(t.nbytes) + " bytes at offset " +
          std::to_string(t.offset) + ", got " + std::to_string(c.start + done);
  } else if (!t.write) {
    if (t.file->stream() && !t.file->direct()) {
      // Only whole folios leave the page cache, and the one straddling the previous read's end was not whole
      // then: reach back a chunk. Round the end up, so that the last page of the file goes too.
      const uint64_t pos = t.offset + c.start, lo = pos > kChunk ? pos - kChunk : 0;
      t.file->drop_cache(lo, (pos + c.len + kAlign - 1) / kAlign * kAlign - lo);
    }
    checksum();
  }
  if (err) {
    std::lock_guard lock(t.err_mu);
    if (!t.err || c.start < t.err_at) {
      t.err = err;
      t.err_at = c.start;
      t.err_msg = std::move(msg);
    }
  }
  if (t.remaining.fetch_sub(1) == 1) finish(t);
}

void IOPool::finish(Ticket& t) {
  if (!t.err) {
    t.crcs.reserve(t.segments.size());
    for (size_t i = 0; i < t.segments.size(); i++) {
      const Segment& s = t.segments[i];
      uint32_t crc = 0;
      for (uint64_t j = 0, k = first_chunk(s); j < piece_count(s); j++, k++) {
        const uint64_t lo = std::max(s.first, k * kChunk), hi = std::min(s.first + s.second, (k + 1) * kChunk);
        crc = crc32c_combine(crc, t.pieces[t.first_piece[i] + j], hi - lo);
      }
      t.crcs.push_back(crc);
    }
    (t.write ? writes_ : reads_)++;
  }
  {
    std::lock_guard lock(mu_);
    t.done = true;
  }
  done_cv_.notify_all();
}

std::vector<uint32_t> IOPool::wait(uint64_t ticket) {
  std::unique_lock lock(mu_);
  auto it = tickets_.find(ticket);
  if (it == tickets_.end())
    throw std::invalid_argument("unknown ticket " + std::to_string(ticket) + " (never submitted, or already waited)");
  std::shared_ptr<Ticket> t = std::move(it->second);
  tickets_.erase(it);
  done_cv_.wait(lock, [&] { return t->done; });
  lock.unlock();
  if (t->err) throw OsError(t->err, t->err_msg);
  return std::move(t->crcs);
}

void IOPool::wait_all() {
  std::unique_lock lock(mu_);
  std::map<uint64_t, std::shared_ptr<Ticket>> pending;
  pending.swap(tickets_);
  for (auto& entry : pending) done_cv_.wait(lock, [&] { return entry.second->done; });
  lock.unlock();
  for (auto& entry : pending)
    if (entry.second->err) throw OsError(entry.second->err, entry.second->err_msg);
}

}  // namespace ds
