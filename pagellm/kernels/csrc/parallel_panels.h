// How the panel kernels (gemm.cpp, gemm_bf16.cpp, gemm_int8.cpp) spread a product's panels over
// the threads: in chunks that each thread takes as it comes free (OpenMP's dynamic schedule), not
// in one even share per thread fixed up front. On a machine of few cores that also runs the
// server's event loop, its client and other tenants, one thread of a product is often preempted
// for a while; with fixed shares the whole product waits for it, with chunks the others take over
// its work. About 8 chunks a thread keep the hand-over fine and its cost (one atomic per chunk) nil.
// Within a panel, the rows of x go through micro-tiles of sizes RowBlocks gives.
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

// m rows split into one row block (up to mr_max rows) or ceil(m / mr) of as even sizes as can be
// (32 rows in tiles of 6: 6, 6, 5, 5, 5, 5 rather than 5 x 6 and 2): a tile of few rows spends
// more per row on reading or unpacking the weights.
struct RowBlocks {
  int64_t count, base, extra;  // the first `extra` blocks have base + 1 rows, the others base
  RowBlocks(int64_t m, int mr, int mr_max)
      : count(m <= mr_max ? 1 : (m + mr - 1) / mr), base(m / count), extra(m % count) {}
  int64_t start(int64_t j) const { return j * base + std::min(j, extra); }
  int rows(int64_t j) const { return static_cast<int>(base + (j < extra ? 1 : 0)); }
  int64_t block_of(int64_t r) const {
    const int64_t split = extra * (base + 1);
    return r < split ? r / (base + 1) : extra + (r - split) / base;
  }
};

}  // namespace pagellm
