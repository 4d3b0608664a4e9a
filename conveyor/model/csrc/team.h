// A team of threads that stays in one parallel region across many ops (decode_layers.cpp): the barrier its threads
// meet at between two ops, and each thread's share of an op's rows.
//
// The ops of a 64-row decode step are short (30 layers x 8 ops in ~35 ms); run one parallel region each, every op
// paid a fork and a join, and the calling thread's work between them (the next op's checks and output tensor)
// was time the other thread spent waiting: ~15% of its time in a W1 decode step (perf, benchmarks/RESULTS.md s29).
#pragma once

#include <atomic>
#include <cstdint>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace conveyor_team {

// The `threads` threads of a team wait at wait() until all of them are there (reusable: a count and a generation).
// A waiting thread spins for about what an op's imbalance lasts, then yields its core between checks: on a machine
// shared with other work the thread it waits for may need that core. abort() releases every wait, now and later
// (a thread that failed), and wait() then returns false.
class SpinBarrier {
 public:
  bool wait(int64_t threads) {
    const int64_t generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == threads) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_release);
      return !aborted_.load(std::memory_order_acquire);
    }
    for (int64_t spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins) {
      if (aborted_.load(std::memory_order_acquire)) return false;
      if (spins < kSpins) {
#if defined(__x86_64__)
        _mm_pause();
#endif
      } else {
        std::this_thread::yield();
      }
    }
    return !aborted_.load(std::memory_order_acquire);
  }

  void abort() { aborted_.store(true, std::memory_order_release); }

 private:
  static constexpr int64_t kSpins = 4096;  // ~50-150 us of pause instructions
  alignas(64) std::atomic<int64_t> arrived_{0};
  alignas(64) std::atomic<int64_t> generation_{0};
  std::atomic<bool> aborted_{false};
};

// Thread `thread` of `threads`: its rows [begin, end) of `rows`, in thread order (some may get none).
struct RowShare {
  int64_t begin, end;
};

inline RowShare row_share(int64_t rows, int64_t thread, int64_t threads) {
  return {rows * thread / threads, rows * (thread + 1) / threads};
}

}  // namespace conveyor_team
