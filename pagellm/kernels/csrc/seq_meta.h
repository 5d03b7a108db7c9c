// What the recurrent-state kernels (recurrent.cpp, mamba.cpp) share: float32 / bfloat16 element
// access, and the flat batch's per-sequence metadata (query_start_loc, slot_ids, has_initial_state,
// checkpoints), read and checked once per call. Semantics: pagellm/kernels/recurrent.py.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace pagellm {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}

// fn(float{}) or fn(at::BFloat16{}): the element type of a float32 or bfloat16 tensor.
template <typename Fn>
inline void dispatch_float_bf16(at::ScalarType dtype, Fn&& fn) {
  if (dtype == at::kBFloat16) {
    fn(at::BFloat16{});
  } else {
    fn(float{});
  }
}

struct SeqMeta {
  std::vector<int64_t> starts, slots, cp_begin;  // cp_begin[i]..cp_begin[i + 1]: sequence i's checkpoint rows
  std::vector<bool> initial;
  const int64_t* cps = nullptr;  // [M, 3] rows (sequence, offset, slot)
  int64_t num_seqs = 0;
};

inline SeqMeta read_meta(const at::Tensor& query_start_loc, const at::Tensor& slot_ids,
                         const at::Tensor& has_initial_state, const at::Tensor& checkpoints, int64_t num_tokens,
                         int64_t num_slots, const char* op) {
  TORCH_CHECK_VALUE(
      query_start_loc.scalar_type() == at::kLong && query_start_loc.is_contiguous() && query_start_loc.dim() == 1, op,
      ": query_start_loc must be a contiguous int64 vector");
  TORCH_CHECK_VALUE(slot_ids.scalar_type() == at::kLong && slot_ids.is_contiguous(), op,
                    ": slot_ids must be contiguous int64");
  TORCH_CHECK_VALUE(has_initial_state.scalar_type() == at::kBool && has_initial_state.is_contiguous(), op,
                    ": has_initial_state must be contiguous bool");
  TORCH_CHECK_VALUE(checkpoints.scalar_type() == at::kLong && checkpoints.is_contiguous() && checkpoints.dim() == 2 &&
                        checkpoints.size(1) == 3,
                    op, ": checkpoints must be a contiguous int64 [M, 3] tensor");
  SeqMeta m;
  m.num_seqs = query_start_loc.numel() - 1;
  TORCH_CHECK_VALUE(m.num_seqs >= 0 && slot_ids.numel() == m.num_seqs && has_initial_state.numel() == m.num_seqs, op,
                    ": query_start_loc must have one more entry than slot_ids and has_initial_state");
  const int64_t* qsl = query_start_loc.data_ptr<int64_t>();
  const int64_t* sl = slot_ids.data_ptr<int64_t>();
  const bool* hi = has_initial_state.data_ptr<bool>();
  m.starts.assign(qsl, qsl + m.num_seqs + 1);
  m.slots.assign(sl, sl + m.num_seqs);
  m.initial.assign(hi, hi + m.num_seqs);
  TORCH_CHECK_VALUE(m.num_seqs == 0 || (m.starts[0] >= 0 && m.starts[m.num_seqs] <= num_tokens), op,
                    ": query_start_loc out of the batch's rows");
  for (int64_t i = 0; i < m.num_seqs; ++i) {
    TORCH_CHECK_VALUE(m.starts[i] <= m.starts[i + 1], op, ": query_start_loc must be ascending");
    TORCH_CHECK_VALUE(m.slots[i] >= 0 && m.slots[i] < num_slots, op, ": slot_ids[", i, "] out of range");
  }
  m.cps = checkpoints.data_ptr<int64_t>();
  const int64_t rows = checkpoints.size(0);
  m.cp_begin.assign(m.num_seqs + 1, 0);
  int64_t prev_seq = -1, prev_off = 0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = m.cps[3 * r], o = m.cps[3 * r + 1], s = m.cps[3 * r + 2];
    TORCH_CHECK_VALUE(
        i >= 0 && i < m.num_seqs && o >= 1 && o <= m.starts[i + 1] - m.starts[i] && s >= 0 && s < num_slots, op,
        ": checkpoint row ", r, " out of range");
    TORCH_CHECK_VALUE(i > prev_seq || (i == prev_seq && o >= prev_off), op,
                      ": checkpoints must be sorted by (sequence, offset)");
    prev_seq = i;
    prev_off = o;
    m.cp_begin[i + 1] += 1;
  }
  for (int64_t i = 0; i < m.num_seqs; ++i) m.cp_begin[i + 1] += m.cp_begin[i];
  return m;
}

}  // namespace pagellm
