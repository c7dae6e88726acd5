// Runs a kernel's output columns on XLA's intra-op thread pool: shared by
// cpu_matmul.cc (float32 weights) and cpu_qmatmul.cc (quantized weights).

#ifndef SPECJAX_KERNELS_PARALLEL_COLUMNS_H_
#define SPECJAX_KERNELS_PARALLEL_COLUMNS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace specjax {

// Runs body(j0, j1) over [0, n) in chunks of `chunk` columns on the calling
// thread and the pool's other threads. Chunks are claimed from a shared
// counter, so the caller finishes every chunk no helper has started; it then
// waits only for chunks already running. The state is shared with the helper
// tasks, which may start after the call has returned.
template <typename Body>
inline void ParallelColumns(xla::ffi::ThreadPool& pool, int64_t n, int64_t chunk, Body body) {
  const int64_t num_chunks = (n + chunk - 1) / chunk;
  const int64_t helpers = std::min<int64_t>(pool.num_threads() - 1, num_chunks - 1);
  if (helpers <= 0) {
    body(0, n);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto state = std::make_shared<State>();
  auto work = [state, num_chunks, chunk, n, body]() {
    for (int64_t c; (c = state->next.fetch_add(1)) < num_chunks;) {
      body(c * chunk, std::min(n, (c + 1) * chunk));
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule(decltype(work)(work));
  work();
  while (state->done.load(std::memory_order_acquire) < num_chunks) std::this_thread::yield();
}

// One chunk per thread (XLA runs the call on one of the pool's threads), a
// multiple of 64 columns (the widest register tile) and at least 256, so a
// chunk's work outweighs claiming it. Whole rows of w per chunk keep its
// memory streams long.
inline int64_t ChunkColumns(int64_t n, int64_t threads) {
  const int64_t parts = std::max<int64_t>(1, threads);
  const int64_t chunk = (n + parts - 1) / parts;
  return std::max<int64_t>(256, (chunk + 63) / 64 * 64);
}

}  // namespace specjax

#endif  // SPECJAX_KERNELS_PARALLEL_COLUMNS_H_
