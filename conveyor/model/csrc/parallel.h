// The kernels' split of work over threads, on OpenMP directly (the runtime torch itself uses: torch's
// set_num_threads sets OpenMP's thread count, so omp_get_max_threads() here is torch.get_num_threads()).
//
// parallel_for(begin, end, grain, f) splits exactly as ATen's at::parallel_for does under OpenMP, so every output
// is computed by the same arithmetic in the same order as before, whatever the thread count:
//   - runs f(begin, end) on the calling thread when end - begin <= grain, when there is one thread, or inside
//     another parallel region (or another parallel_for's body);
//   - otherwise threads = min(OpenMP's team, ceil((end - begin) / grain)), chunk = ceil((end - begin) / threads),
//     and thread t runs f(begin + t chunk, min(end, begin + (t + 1) chunk)) when that range is not empty.
// An exception thrown by f on any thread is rethrown on the calling thread after the region (the first one).
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>

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
  std::atomic_flag failed = ATOMIC_FLAG_INIT;
  std::exception_ptr error;
#pragma omp parallel
  {
    int64_t threads = omp_get_num_threads();
    if (grain > 0) threads = std::min<int64_t>(threads, (count + grain - 1) / grain);
    const int64_t tid = omp_get_thread_num();
    const int64_t chunk = (count + threads - 1) / threads;
    const int64_t first = begin + tid * chunk;
    if (first < end) {
      try {
        const BodyGuard guard;
        thread_index() = tid;
        f(first, std::min(end, first + chunk));
        thread_index() = 0;
      } catch (...) {
        thread_index() = 0;
        if (!failed.test_and_set()) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace conveyor_parallel
