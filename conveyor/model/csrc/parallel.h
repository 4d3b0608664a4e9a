// The kernels' split of work over threads: torch's thread count (OpenMP's: torch.set_num_threads sets it, so
// omp_get_max_threads() here is torch.get_num_threads()), run on a pool of the kernels' own that never waits for a
// thread that has not started.
//
// parallel_for(begin, end, grain, f) splits exactly as ATen's at::parallel_for does under OpenMP, so every output
// is computed by the same arithmetic in the same order, whatever the thread count and whichever thread runs it:
//   - runs f(begin, end) on the calling thread when end - begin <= grain, when there is one thread, or inside
//     another parallel region (or another parallel_for's body);
//   - otherwise threads = min(torch's count, ceil((end - begin) / grain)), chunk = ceil((end - begin) / threads),
//     and chunk t is f(begin + t chunk, min(end, begin + (t + 1) chunk)) when that range is not empty, run with
//     thread_index() = t.
// Chunks are claimed, not assigned: the calling thread runs chunks itself and waits only for the chunks another
// thread has claimed. On a machine shared with other busy processes a worker the scheduler has not run yet costs
// nothing (the caller takes its chunk), where a fork-join team (OpenMP's) would wait a time slice for it at every
// call: hundreds of calls per decode step. Idle workers spin briefly (kSpins), then sleep.
// An exception thrown by f on any thread is rethrown on the calling thread after the call (the first one).
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define CONVEYOR_PAUSE() _mm_pause()
#else
#define CONVEYOR_PAUSE() std::this_thread::yield()
#endif

namespace conveyor_parallel {

// Whether this thread is inside a parallel_for's body (nested calls then run serially, as ATen's do).
inline bool& in_body() {
  thread_local bool flag = false;
  return flag;
}

struct BodyGuard {
  bool previous;
  BodyGuard() : previous(in_body()) { in_body() = true; }
  ~BodyGuard() { in_body() = previous; }
};

// The threads an op splits its work for: OpenMP's count for a region started here (as at::get_num_threads()).
inline int64_t num_threads() { return omp_get_max_threads(); }

// The calling thread's index in its parallel_for (0 outside one; as at::get_thread_num()).
inline int64_t& thread_index() {
  thread_local int64_t index = 0;
  return index;
}

namespace detail {

// Pause loops an idle worker spins for the next call before it sleeps (a decode step's calls follow each other
// within microseconds; a sleeping worker costs a wake-up). Tuned with `conveyor bench latency` idle and beside a
// busy process.
constexpr int kSpins = 4000;

// Pause loops the caller spins for a claimed chunk before it yields its core to whoever runs that chunk.
constexpr int kWaitSpins = 2000;

using ChunkCall = void (*)(const void* context, int64_t chunk);

class Pool {
 public:
  // Leaked on purpose: workers outlive static destruction at exit.
  static Pool& get() {
    static Pool* pool = new Pool();
    return *pool;
  }

  // call(context, c) for c in [0, chunks): on the caller and on the workers that wake in time; returns when all
  // have run. One call at a time: a caller that finds the pool busy (another host thread's kernel) runs its
  // chunks alone, in order.
  void run(int64_t chunks, int64_t threads, ChunkCall call, const void* context) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || chunks > kMaxChunks) {
      for (int64_t c = 0; c < chunks; ++c) call(context, c);
      return;
    }
    grow(threads - 1);
    call_.store(call, std::memory_order_relaxed);
    context_.store(context, std::memory_order_relaxed);
    finished_.store(0, std::memory_order_relaxed);
    const uint64_t epoch = ++epoch_counter_ & 0xFFFFFFFFu;
    claim_.store(epoch << 32 | static_cast<uint64_t>(chunks) << 16, std::memory_order_release);
    epoch_.store(static_cast<uint32_t>(epoch), std::memory_order_seq_cst);
    if (sleeping_.load(std::memory_order_seq_cst) > 0) {
      const std::lock_guard<std::mutex> lock(sleep_mutex_);
      wake_.notify_all();
    }
    work(static_cast<uint32_t>(epoch));
    for (int spins = 0; finished_.load(std::memory_order_acquire) < chunks; ++spins) {
      if (spins < kWaitSpins) {
        CONVEYOR_PAUSE();
      } else {
        std::this_thread::yield();
      }
    }
  }

 private:
  static constexpr int64_t kMaxChunks = 0xFFFF;

  Pool() = default;

  void grow(int64_t workers) {
    while (static_cast<int64_t>(workers_started_) < workers) {
      std::thread([this] { serve(); }).detach();
      ++workers_started_;
    }
  }

  // Claims and runs chunks of the call of this epoch until none is left (or a later call has begun).
  void work(uint32_t epoch) {
    for (;;) {
      uint64_t claim = claim_.load(std::memory_order_acquire);
      for (;;) {
        const int64_t next = static_cast<int64_t>(claim & 0xFFFF), chunks = static_cast<int64_t>(claim >> 16 & 0xFFFF);
        if ((claim >> 32) != epoch || next >= chunks) return;
        if (claim_.compare_exchange_weak(claim, claim + 1, std::memory_order_acq_rel)) {
          // chunk `next` is ours: the call's fields stay valid until every chunk has finished
          call_.load(std::memory_order_relaxed)(context_.load(std::memory_order_relaxed), next);
          finished_.fetch_add(1, std::memory_order_release);
          break;
        }
      }
    }
  }

  [[noreturn]] void serve() {
    uint32_t seen = epoch_.load(std::memory_order_acquire);
    for (;;) {
      uint32_t epoch = epoch_.load(std::memory_order_acquire);
      for (int spins = 0; epoch == seen && spins < kSpins; ++spins) {
        CONVEYOR_PAUSE();
        epoch = epoch_.load(std::memory_order_acquire);
      }
      if (epoch == seen) {
        std::unique_lock<std::mutex> lock(sleep_mutex_);
        sleeping_.fetch_add(1, std::memory_order_seq_cst);
        wake_.wait(lock, [&] { return epoch_.load(std::memory_order_seq_cst) != seen; });
        sleeping_.fetch_sub(1, std::memory_order_relaxed);
        epoch = epoch_.load(std::memory_order_acquire);
      }
      seen = epoch;
      work(epoch);
    }
  }

  std::mutex busy_;
  uint64_t epoch_counter_ = 0;      // under busy_
  int64_t workers_started_ = 0;     // under busy_
  std::atomic<uint64_t> claim_{0};  // epoch << 32 | chunks << 16 | next chunk to claim
  std::atomic<uint32_t> epoch_{0};  // the latest call's epoch, which workers wait on
  std::atomic<int64_t> finished_{0};
  std::atomic<ChunkCall> call_{nullptr};
  std::atomic<const void*> context_{nullptr};
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<int> sleeping_{0};
};

}  // namespace detail

template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (begin >= end) return;
  const int64_t count = end - begin;
  if (!(count > grain && count > 1 && !omp_in_parallel() && !in_body() && omp_get_max_threads() > 1)) {
    const BodyGuard guard;
    const int64_t saved = thread_index();
    thread_index() = 0;
    f(begin, end);
    thread_index() = saved;
    return;
  }
  int64_t threads = omp_get_max_threads();
  if (grain > 0) threads = std::min<int64_t>(threads, (count + grain - 1) / grain);
  const int64_t chunk = (count + threads - 1) / threads;
  struct Context {
    const F* f;
    int64_t begin, end, chunk;
    std::atomic_flag failed = ATOMIC_FLAG_INIT;
    std::exception_ptr error;
  } context{&f, begin, end, chunk};
  const detail::ChunkCall call = [](const void* opaque, int64_t t) {
    auto* c = const_cast<Context*>(static_cast<const Context*>(opaque));
    const int64_t first = c->begin + t * c->chunk;
    if (first >= c->end) return;
    const BodyGuard guard;
    const int64_t saved = thread_index();
    try {
      thread_index() = t;
      (*c->f)(first, std::min(c->end, first + c->chunk));
    } catch (...) {
      if (!c->failed.test_and_set()) c->error = std::current_exception();
    }
    thread_index() = saved;
  };
  detail::Pool::get().run(threads, threads, call, &context);
  if (context.error) std::rethrow_exception(context.error);
}

}  // namespace conveyor_parallel
