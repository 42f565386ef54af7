// What dflax's CPU kernels share: the sum of a vector's eight float32 lanes in one fixed order, and a loop
// over independent work items spread over XLA's intra-op thread pool.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace dflax {

// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)): the same tree of adds for every call.
inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Runs run(item) for every item in [0, count), on the calling thread and on up to num_threads - 1 pool
// tasks. Items are handed out by an atomic counter and the caller waits only for items a task has already
// taken, so a task the pool starts late finds nothing left (it holds its own copy of `run` and of the
// counters) and a busy pool never blocks the call.
template <typename Run>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t count, const Run& run) {
  struct Counters {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto counters = std::make_shared<Counters>();
  auto take_items = [counters, count, run] {
    for (int64_t item; (item = counters->next.fetch_add(1)) < count;) {
      run(item);
      counters->done.fetch_add(1, std::memory_order_release);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), count) - 1;
  for (int64_t i = 0; i < helpers; ++i) {
    auto task = take_items;  // Schedule takes its task by value (an rvalue)
    pool.Schedule(std::move(task));
  }
  take_items();
  while (counters->done.load(std::memory_order_acquire) < count) _mm_pause();
}

}  // namespace dflax
