#include "copy.h"

#include "crc32c.h"

#include <pthread.h>

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

void Checksums::finish_part(const Part& part, uint32_t crc) {
  std::lock_guard lock(mu_);
  partial_[part.range][part.index] = crc;
  if (--remaining_) return;
  crcs_.resize(partial_.size());
  for (size_t r = 0; r < partial_.size(); r++) {  // pieces combined in order; all but the last are kCopyPiece
    const auto& pieces = partial_[r];
    uint32_t crc_r = pieces.empty() ? 0 : pieces[0];
    for (size_t k = 1; k < pieces.size(); k++)
      crc_r = crc32c_combine(crc_r, pieces[k], k + 1 == pieces.size() ? last_len_[r] : kCopyPiece);
    crcs_[r] = crc_r;
  }
  cv_.notify_all();
}

std::vector<uint32_t> Checksums::wait() {
  std::unique_lock lock(mu_);
  cv_.wait(lock, [this] { return remaining_ == 0; });
  return crcs_;
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
      copies_.push_back(Piece{batch, reinterpret_cast<char*>(dst + off), reinterpret_cast<const char*>(src + off),
                             std::min(kCopyPiece, n - off)});
  }
  cv_.notify_all();
}

std::shared_ptr<Checksums> CopyPool::checksum(const std::shared_ptr<CopyBatch>& after, uintptr_t ptr,
                                              const std::vector<std::pair<uint64_t, uint64_t>>& ranges) {
  if (!ptr && !ranges.empty()) throw std::invalid_argument("null pointer");
  auto sums = std::make_shared<Checksums>();
  std::vector<Piece> parts;
  sums->partial_.resize(ranges.size());
  sums->last_len_.resize(ranges.size());
  for (uint64_t r = 0; r < ranges.size(); r++) {
    const auto [start, n] = ranges[r];
    const uint64_t pieces = std::max<uint64_t>(1, (n + kCopyPiece - 1) / kCopyPiece);  // an empty range: crc 0
    sums->partial_[r].assign(pieces, 0);
    sums->last_len_[r] = n - (pieces - 1) * kCopyPiece;
    for (uint64_t k = 0; k < pieces; k++)
      parts.push_back(Piece{nullptr, nullptr, nullptr, 0, sums, after,
                            Checksums::Part{r, k, reinterpret_cast<const char*>(ptr + start + k * kCopyPiece),
                                            std::min(kCopyPiece, n - k * kCopyPiece)}});
  }
  sums->remaining_ = parts.size();
  if (parts.empty()) return sums;
  {
    std::lock_guard lock(mu_);
    if (stopping_) throw std::runtime_error("CopyPool is closed");
    for (auto& part : parts) sums_.push_back(std::move(part));
  }
  cv_.notify_all();
  return sums;
}

void CopyPool::run_copy(const Piece& p) {
  std::memcpy(p.dst, p.src, p.n);
  p.batch->finish_one();
}

uint64_t CopyPool::run_copies() {
  for (uint64_t ran = 0;; ran++) {
    Piece p;
    {
      std::lock_guard lock(mu_);
      if (copies_.empty()) return ran;
      p = std::move(copies_.front());
      copies_.pop_front();
    }
    run_copy(p);
  }
}

bool CopyPool::copies_queued() {
  std::lock_guard lock(mu_);
  return !copies_.empty();
}

void CopyPool::worker() {
  (void)::pthread_setname_np(::pthread_self(), "ds-copy-pool");  // training's priority: the fence waits on it
  for (;;) {
    Piece p;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !copies_.empty() || !sums_.empty(); });
      auto& from = copies_.empty() ? sums_ : copies_;
      if (from.empty()) return;  // stopping, and everything queued has been done
      p = std::move(from.front());
      from.pop_front();
    }
    if (p.sums) {
      // No copy is queued (copies go first), so every copy of `after` is taken by now (by a pool thread or a caller
      // in run_copies, which runs no checksum): waiting cannot deadlock.
      if (p.after) p.after->wait();
      p.sums->finish_part(p.part, crc32c(0, p.part.p, p.part.n));
      continue;
    }
    run_copy(p);
  }
}

}  // namespace ds
