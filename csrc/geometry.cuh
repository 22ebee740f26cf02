// Rows on the device: the block-wide RMS factor, row-chunk iteration, and a launch's layout geometry
// (every rank's count, offset and buffer base, checked once per launch) with ordered calls' positions.
#pragma once

#include "common.cuh"

namespace nsa_cp {

// ---- row-chunk iteration ---------------------------------------------------------------------------

// The RMS factor 1 / sqrt(mean(x^2) + eps) of a row of `hidden` elements held across the block:
// `ss` is this thread's partial sum of squares, `red` a shared float[kDataThreads / 32] (callers
// alternate two by row parity, so no barrier is needed between one row's reads and the next's writes).
__device__ __forceinline__ float block_rstd(float ss, float* red, int64_t hidden, float eps) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kDataThreads / 32; ++i) total += red[i];
  return 1.0f / sqrtf(total / static_cast<float>(hidden) + eps);
}

// Unsigned word of VEC bytes (16, 4, 2 or 1): the unit of every load and store of the data-movement
// kernels.
template <int VEC>
struct Word {
  static_assert(VEC == 16 || VEC == 4 || VEC == 2 || VEC == 1, "words are 16, 4, 2 or 1 bytes");
  using type = std::conditional_t<VEC == 16, uint4,
                                  std::conditional_t<VEC == 4, uint32_t, std::conditional_t<VEC == 2, uint16_t, uint8_t>>>;
};

// Grid-stride walk over (row, chunk) pairs of a [rows, chunks] work grid without a division per step:
// the stride is split once into whole rows plus leftover chunks.
struct RowChunkCursor {
  int64_t row, chunk;
  int64_t chunks, step_rows, step_chunks;
  __device__ __forceinline__ RowChunkCursor(int64_t start, int64_t stride, int64_t chunks_per_row)
      : row(start / chunks_per_row),
        chunk(start % chunks_per_row),
        chunks(chunks_per_row),
        step_rows(stride / chunks_per_row),
        step_chunks(stride % chunks_per_row) {}
  __device__ __forceinline__ void advance() {
    chunk += step_chunks;
    row += step_rows;
    if (chunk >= chunks) {
      chunk -= chunks;
      ++row;
    }
  }
};

__device__ __forceinline__ int64_t global_thread() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t grid_threads() { return static_cast<int64_t>(gridDim.x) * blockDim.x; }

// Device-side arguments every data kernel checks (counts/offsets come from device memory so that
// CUDA-graph replays may change them). Returns the first rank whose entry is unusable, or -1.
// Both layouts: 0 <= counts[q] <= M (M = max_rank_len); compact: offsets = exclusive prefix sum of
// counts. That bounds every row index the kernels compute, whatever the device memory holds.
__device__ __forceinline__ int first_bad_layout_rank(const int* counts, const int* offsets, int world, int64_t M,
                                                     bool compact) {
  int64_t prefix = 0;
  for (int q = 0; q < world; ++q) {
    const int c = counts[q];
    if (c < 0 || c > M) return q;
    if (compact) {
      if (offsets[q] != prefix) return q;
      prefix += c;
    }
  }
  return -1;
}

// What every data kernel reads first: every rank's (mapped) buffer base, count and offset, staged in
// shared memory. They live in device memory and may change between CUDA-graph replays.
struct Geometry {
  uint64_t bufs[kMaxWorld];
  int counts[kMaxWorld];
  int offsets[kMaxWorld];  // compact only (0 otherwise)
};

// Rank t's entry of the geometry, in thread t's registers (t < world; zeros elsewhere). Load it first
// thing in a launch, before the epoch: plain loads issued ahead of the epoch's load (an asm with a
// memory clobber, which later loads cannot pass) are in flight together with it, so the launch pays
// one memory latency before it can move data instead of two.
struct GeometryEntry {
  uint64_t buf = 0;
  int count = 0;
  int offset = 0;
};

__device__ __forceinline__ GeometryEntry load_geometry_entry(const uint64_t* bufs, const int* counts,
                                                             const int* offsets, bool compact, int world) {
  GeometryEntry e;
  const int t = static_cast<int>(threadIdx.x);
  if (t < world) {
    e.buf = bufs[t];
    e.count = counts[t];
    e.offset = compact ? offsets[t] : 0;
  }
  return e;
}

// Stages the geometry (from every thread's load_geometry_entry) into `g` (shared memory; call from all
// threads) and checks it: counts in range, compact offsets the prefix sum, every buffer non-null and
// aligned to `word_bytes`, and this rank's own tensor (`local`: the gather's source, the
// reduce-scatter's output) non-null when it has rows.
// Returns the first bad rank, or -1. Every block reaches the same verdict; block 0 records the error,
// and a bad launch skips its data movement but still completes the signal protocol, so no peer hangs.
//
// `num_positions` >= 0 (an ordered call: compact geometry, rows land at positions[i]): the total count
// must also be <= num_positions, so that every index into positions stays inside it.
__device__ __forceinline__ int stage_geometry(Geometry& g, const GeometryEntry& entry, int64_t M, bool compact,
                                              int word_bytes, const void* local, const SignalArgs& s,
                                              uint32_t epoch, int64_t num_positions = -1) {
  const int t = static_cast<int>(threadIdx.x);
  if (t < s.world) {
    g.bufs[t] = entry.buf;
    g.counts[t] = entry.count;
    g.offsets[t] = entry.offset;
  }
  __syncthreads();
  int bad = first_bad_layout_rank(g.counts, g.offsets, s.world, M, compact);
  for (int q = 0; bad < 0 && q < s.world; ++q) {
    if (g.bufs[q] == 0 || g.bufs[q] % word_bytes != 0) bad = q;
  }
  if (bad < 0 && g.counts[s.rank] > 0 && local == nullptr) bad = s.rank;
  if (bad < 0 && num_positions >= 0) {
    int64_t total = 0;
    for (int q = 0; q < s.world; ++q) total += g.counts[q];
    if (total > num_positions) bad = s.world - 1;  // the last rank's rows would index past positions
  }
  if (bad >= 0 && blockIdx.x == 0 && t == 0) {
    record_error(s.err, kErrBadDeviceArg, static_cast<uint32_t>(s.channel * 2), static_cast<uint32_t>(bad), epoch);
  }
  return bad;
}

// Row `i` of an ordered call: positions[i] (i < the total count, checked by stage_geometry), or, when
// it lies outside [0, num_positions), that value clamped into the range, recorded as kErrBadPosition:
// a bad position never makes a kernel touch memory outside the [num_positions] rows it was given.
__device__ __forceinline__ int64_t position_row(const int64_t* positions, int64_t num_positions, int64_t i,
                                                const SignalArgs& s, uint32_t epoch) {
  int64_t d = __ldg(positions + i);
  if (d < 0 || d >= num_positions) {
    record_error(s.err, kErrBadPosition, static_cast<uint32_t>(s.channel * 2), static_cast<uint32_t>(s.rank), epoch);
    d = d < 0 ? 0 : num_positions - 1;
  }
  return d;
}

}  // namespace nsa_cp
