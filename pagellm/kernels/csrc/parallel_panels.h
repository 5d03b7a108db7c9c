// How the panel kernels (gemm.cpp, gemm_bf16.cpp, gemm_int8.cpp) spread a product's panels over
// the threads: in chunks that each thread takes as it comes free (OpenMP's dynamic schedule), not
// in one even share per thread fixed up front. On a machine of few cores that also runs the
// server's event loop, its client and other tenants, one thread of a product is often preempted
// for a while; with fixed shares the whole product waits for it, with chunks the others take over
// its work. About 8 chunks a thread keep the hand-over fine and its cost (one atomic per chunk) nil.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace pagellm {

constexpr int64_t kChunksPerThread = 8;

// fn(begin, end) over [0, count) in chunks, on all of torch's threads.
template <typename F>
inline void parallel_panels(int64_t count, const F& fn) {
  const int threads = at::get_num_threads();
  if (count <= 0) return;
  if (threads <= 1 || count == 1 || at::in_parallel_region()) {
    fn(int64_t{0}, count);
    return;
  }
  const int64_t per_chunk = std::max<int64_t>(1, count / (threads * kChunksPerThread));
  const int64_t chunks = (count + per_chunk - 1) / per_chunk;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t c = 0; c < chunks; ++c) fn(c * per_chunk, std::min(count, (c + 1) * per_chunk));
}

}  // namespace pagellm
