#include "copy.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

namespace ds {

void CopyBatch::add(uint64_t n) {
  std::lock_guard lock(mu_);
  remaining_ += n;
}

void CopyBatch::finish_one() {
  std::lock_guard lock(mu_);
  if (--remaining_ == 0) cv_.notify_all();
}

void CopyBatch::wait() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [this] { return remaining_ == 0; });
}

bool CopyBatch::done() {
  std::lock_guard lock(mu_);
  return remaining_ == 0;
}

CopyPool::CopyPool(int threads) {
  if (threads < 1) throw std::invalid_argument("CopyPool needs at least one thread");
  try {
    for (int i = 0; i < threads; i++) threads_.emplace_back(&CopyPool::worker, this);
  } catch (...) {
    close();
    throw;
  }
}

CopyPool::~CopyPool() { close(); }

void CopyPool::close() {
  std::lock_guard closing(close_mu_);
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
}

void CopyPool::copy(const std::shared_ptr<CopyBatch>& batch, uintptr_t dst, uintptr_t src, uint64_t n) {
  if (!batch) throw std::invalid_argument("batch must be a CopyBatch");
  if (n && (!dst || !src)) throw std::invalid_argument("null pointer");
  const uint64_t pieces = (n + kCopyPiece - 1) / kCopyPiece;
  if (!pieces) return;
  batch->add(pieces);  // before queueing: a fast worker must not see the batch complete early
  {
    std::lock_guard lock(mu_);
    if (stopping_) {
      for (uint64_t k = 0; k < pieces; k++) batch->finish_one();
      throw std::runtime_error("CopyPool is closed");
    }
    for (uint64_t off = 0; off < n; off += kCopyPiece)
      queue_.push_back(Piece{batch, reinterpret_cast<char*>(dst + off), reinterpret_cast<const char*>(src + off),
                             std::min(kCopyPiece, n - off)});
  }
  cv_.notify_all();
}

void CopyPool::worker() {
  for (;;) {
    Piece p;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything queued has been copied
      p = std::move(queue_.front());
      queue_.pop_front();
    }
    std::memcpy(p.dst, p.src, p.n);
    p.batch->finish_one();
  }
}

}  // namespace ds
