// A team of threads that stays in one parallel region across many ops (decode_layers.cpp): the barrier its threads
// meet at between two ops, and each thread's share of an op's rows.
//
// The ops of a decode step are short; run in one parallel region each, every op pays a fork and a join, and the
// calling thread's work between them (the next op's checks and output tensor) is time the other threads wait.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace conveyor_team {

static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t), "a barrier's generation is a futex word");

// The `threads` threads of a team wait at wait() until all of them are there (reusable: a count and a generation).
// A waiting thread spins for about what an op's imbalance lasts (kSpins pause instructions), then sleeps on the
// generation (a futex) until the last one arrives and wakes it: on a machine shared with other busy processes the
// thread it waits for may need its core. kSpins trades an idle machine's wake-up latency (more spins) against a
// shared machine's stolen core (fewer); tuned with `conveyor bench decode-step`, idle and beside a busy process.
// Exactness is not at stake: the barrier only orders the ops; each op's outputs are computed as without it.
// abort() releases every wait, now and later (a thread that failed), and wait() then returns false.
class SpinBarrier {
 public:
  bool wait(int64_t threads) {
    const uint32_t generation = generation_.load();
    if (arrived_.fetch_add(1) + 1 == threads) {
      arrived_.store(0);
      generation_.fetch_add(1);
      if (sleepers_.load() > 0) wake();
      return !aborted_.load();
    }
    for (int64_t spins = 0; spins < kSpins; ++spins) {
      if (generation_.load(std::memory_order_acquire) != generation) return !aborted_.load();
#if defined(__x86_64__)
      _mm_pause();
#endif
    }
    sleepers_.fetch_add(1);  // seq_cst, before the generation is read again: the last thread then sees a sleeper
    while (generation_.load() == generation) {
      syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), FUTEX_WAIT_PRIVATE, generation, nullptr, nullptr,
              0);
    }
    sleepers_.fetch_sub(1);
    return !aborted_.load();
  }

  void abort() {
    aborted_.store(true);
    generation_.fetch_add(1);  // a thread about to sleep on the old generation finds it changed
    wake();
  }

 private:
  void wake() {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(&generation_), FUTEX_WAKE_PRIVATE, INT32_MAX, nullptr, nullptr, 0);
  }

  static constexpr int64_t kSpins = 3000;  // pause instructions before sleeping
  alignas(64) std::atomic<int64_t> arrived_{0};
  alignas(64) std::atomic<uint32_t> generation_{0};
  std::atomic<int32_t> sleepers_{0};
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
