// What the P2P kernel families take, between their launchers (p2p_gather.cu, p2p_reduce_scatter.cu)
// and the callers that already checked everything: the free launch functions of ops.h (check, then
// enqueue) and P2PState (checked once at construction, then enqueue per call).
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "codes.h"
#include "common.cuh"

namespace nsa_cp {

// Where a gather writes, the same for every source stage.
struct GatherParams {
  int64_t row_bytes;   // bytes per row of the gather buffer (its row stride); the fp8 stages use `hidden`
  const uint64_t* bufs;
  const int* counts;
  const int* offsets;  // compact only
  int64_t M;           // max_rank_len (padded layout)
  bool compact;
  uint32_t buffer;     // tag of the buffers `bufs` points at
  uint32_t* state;     // local uint32[2]: [0] tag the previous gather wrote, [1] done-counter total consumed
  const int64_t* positions;  // ordered call (compact geometry): compact row i lands at row positions[i]
  int64_t num_positions;     // rows of the ordered output; -1 without positions
  uint32_t fp_flags = 0;     // kFpOn | kFp* flags: carry and compare the call fingerprint (common.cuh); 0: off
};

// The plain push: rows copied from `src` as they are.
struct CopySource {
  const char* src;
  int64_t src_stride;  // bytes
};

// The norm stage: y = rmsnorm(x + residual) (or of x), pushed as rows of the dtype or as fp8 groups.
struct NormSource {
  const char* x;
  int64_t x_stride;      // bytes
  char* residual;        // null: no residual (y = rmsnorm(x), x untouched)
  int64_t res_stride;    // bytes
  const void* weight;    // [hidden], weight_dtype
  int weight_dtype;      // DTYPE_* code
  float eps;
  bool norm;             // false: the fp8 stage quantizes x as it is
  int64_t hidden;        // elements per row
  int64_t scale_offset;  // fp8: byte offset of the scale block in every rank's buffer (q block at 0)
};

void enqueue_gather_copy(const GatherParams& p, const CopySource& src, const SignalArgs& s, int vec, int num_blocks,
                         cudaStream_t stream);
// dtype: DTYPE_* of x, residual and the bf16/fp16/fp32 output rows; words_per_thread: 2 or 4 (the
// row is held in registers: hidden * element size <= words_per_thread * kDataThreads * 16 bytes).
void enqueue_gather_norm(const GatherParams& p, const NormSource& src, const SignalArgs& s, int dtype,
                         int words_per_thread, int quant, int num_blocks, cudaStream_t stream);

struct ReduceParams {
  char* out;
  int64_t out_stride;  // bytes
  int64_t row_bytes;   // hidden * element size, also the row stride of every reduce buffer
  const uint64_t* bufs;
  const int* counts;
  const int* offsets;  // compact only
  int64_t M;
  bool compact;
  const int64_t* positions;  // ordered call: this rank's row i is read from row positions[offsets[rank] + i]
  int64_t num_positions;     // -1 without positions
  uint32_t fp_flags = 0;     // as GatherParams::fp_flags
};

void enqueue_reduce_scatter(const ReduceParams& p, const SignalArgs& s, int dtype, bool vector, int num_blocks,
                            cudaStream_t stream);

// The reduce-scatter's add + RMSNorm epilogue: h = the rank-ordered fp32 sum rounded to the dtype (what
// the plain reduce-scatter returns), s = h + residual in fp32, residual <- s rounded, out = s * rsqrt(
// mean(s^2) + eps) * weight rounded once. One row per block, the row in registers.
struct NormEpilogue {
  char* residual;      // [counts[rank], hidden], updated in place
  int64_t res_stride;  // bytes
  const void* weight;  // [hidden], weight_dtype
  int weight_dtype;
  float eps;
  int64_t hidden;
};

// words_per_thread: 2 or 4 (16-byte words; rows of at most words_per_thread * kDataThreads * 16 bytes).
void enqueue_reduce_scatter_norm(const ReduceParams& p, const NormEpilogue& e, const SignalArgs& s, int dtype,
                                 int words_per_thread, int num_blocks, cudaStream_t stream);

}  // namespace nsa_cp
