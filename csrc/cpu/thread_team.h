// A thread team that lives through a whole forward: torch's intra-op threads (OpenMP) enter one parallel
// region per call, and the members synchronise between ops with a spinning barrier instead of leaving
// and re-entering a parallel region per op (whose cost is that of a small projection).
//
//   run_team(num_threads, [&](Team& team) {
//     ... team.split(n, align) -> this member's [begin, end) of n items ...
//     team.sync();   // every member's writes so far are visible to every member after this
//   });
//
// All members run concurrently for the whole call, so the barrier cannot deadlock; the team has as many
// members as the runtime gave (fewer than asked when nested inside another parallel region: then one).
// Nothing inside may throw (check inputs before the team starts).
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>

#include <ATen/Parallel.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define MTP_CPU_RELAX() _mm_pause()
#else
#define MTP_CPU_RELAX() std::this_thread::yield()
#endif

namespace mtp_core {

constexpr int kSpins = 512;   // ~20-70 us of pause instructions

struct TeamState {
  alignas(64) std::atomic<int> arrived{0};
  alignas(64) std::atomic<int> generation{0};
};

class Team {
 public:
  Team(TeamState& state, int rank, int size) : s_(state), rank_(rank), size_(size) {}
  int rank() const { return rank_; }
  int size() const { return size_; }

  // This member's share [begin, end) of n items, split in chunks of `align` (the last member takes the rest).
  std::pair<int64_t, int64_t> split(int64_t n, int64_t align = 1) const {
    const int64_t chunks = (n + align - 1) / align;
    const int64_t b = chunks * rank_ / size_, e = chunks * (rank_ + 1) / size_;
    return {std::min(n, b * align), std::min(n, e * align)};
  }

  // This member's share [begin, end) of n items of unequal cost (cost(i) >= 0, integer): contiguous, each
  // member's items summing to about 1/size of the total (the first item whose cost prefix reaches the
  // member's start). Every member computes the same prefixes, so the shares tile [0, n) exactly.
  template <typename C>
  std::pair<int64_t, int64_t> split_cost(int64_t n, const C& cost) const {
    if (size_ == 1) return {0, n};
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) total += cost(i);
    // item i starts member m's share when prefix(i) * size >= total * m (the first such i)
    int64_t b = -1, e = n, prefix = 0;
    for (int64_t i = 0; i <= n; ++i) {
      if (b < 0 && prefix * size_ >= total * rank_) b = i;
      if (prefix * size_ >= total * (rank_ + 1) && rank_ + 1 < size_) {
        e = i;
        break;
      }
      if (i < n) prefix += cost(i);
    }
    if (b < 0) b = n;
    return {b, std::max(b, e)};
  }

  void sync() {
    if (size_ == 1) return;
    const int gen = s_.generation.load(std::memory_order_relaxed);
    if (s_.arrived.fetch_add(1, std::memory_order_acq_rel) == size_ - 1) {
      s_.arrived.store(0, std::memory_order_relaxed);
      s_.generation.store(gen + 1, std::memory_order_release);
      return;
    }
    for (int spins = 0; s_.generation.load(std::memory_order_acquire) == gen; ++spins) {
      // a short spin (the others are a few hundred ns away), then give the core up: on a machine with more
      // runnable threads than cores the member we wait for may be the one that needs it
      if (spins < kSpins) MTP_CPU_RELAX(); else std::this_thread::yield();
    }
  }

 private:
  TeamState& s_;
  int rank_, size_;
};

template <typename F>
void run_team(int num_threads, const F& body) {
  TeamState state;
  if (num_threads <= 1 || at::in_parallel_region()) {
    Team team(state, 0, 1);
    body(team);
    return;
  }
  std::atomic<int> members{0}, covered{0};
  at::parallel_for(0, num_threads, 1, [&](int64_t b, int64_t e) {
    // every invocation runs concurrently; count them (the runtime may give fewer threads than asked, and
    // then hands some invocation several indices), wait until all indices are covered, then start
    const int rank = members.fetch_add(1, std::memory_order_acq_rel);
    covered.fetch_add(static_cast<int>(e - b), std::memory_order_acq_rel);
    for (int spins = 0; covered.load(std::memory_order_acquire) < num_threads; ++spins) {
      if (spins < kSpins) MTP_CPU_RELAX(); else std::this_thread::yield();
    }
    // every member incremented `members` before `covered`, so the count is final for all of them now
    Team team(state, rank, members.load(std::memory_order_acquire));
    body(team);
  });
}

}  // namespace mtp_core
