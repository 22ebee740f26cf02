// The source stages of p2p_gather (included by p2p_gather.cu only): where a gathered row comes from,
// and the helpers they share with the kernel.
//
// Source stages. The gather kernel (p2p_gather.cu) is one template over where a row comes from (`Stage`):
//   * CopyStage<VEC>: the rows of `src` as they are, walked as a grid of (row, VEC-byte chunk) pairs, so
//     any row length keeps every thread busy;
//   * NormStage<D, K, Fmt>: one row per block (the RMSNorm needs the whole row): s = x (+ residual) in
//     fp32, residual <- s rounded (in place), y = s * rsqrt(mean(s^2) + eps) * weight in fp32, rounded
//     once, pushed as rows of the dtype (Fmt = NoQuant), or in the wire format Fmt (codes.h): float8_e4m3fn
//     groups of Fmt::kGroup columns with one fp32 scale per group (group_scale below; y is rounded to the
//     dtype before it is quantized). The row lives in registers: K 16-byte words per thread.
// Ordered calls (positions): this rank's compact row i lands at row positions[offsets[rank] + i] of
// the [num_positions] output, instead of row offsets[rank] + i; the destination index is all that
// changes (no extra pass).
//
// FP8 byte layout of a gather buffer of C rows of row_bytes (C = world * rows per rank of that
// buffer): bytes [0, C*H) hold q as [C, H] float8_e4m3fn, row i at i*H; bytes [scale_offset,
// scale_offset + C*(H/G)*4) hold the scales as [C, H/G] float32 (G = Fmt::kGroup), scale_offset = C*H rounded up to
// 16. Both blocks are dense, so any first rows of them are contiguous views. Padding rows (padded
// layout, zeroed locally as ever): q = 0, scale = group_scale<Fmt>(0) (what quantizing a zero row gives).
#pragma once

#include <cuda_fp8.h>

#include "geometry.cuh"
#include "elem.cuh"
#include "p2p_kernels.h"

namespace nsa_cp {
namespace {
constexpr int kUnroll = 4;  // independent loads in flight per thread (copy stage)

// The scale of a group whose |y| peaks at amax, in the wire format Fmt (codes.h): a correctly rounded
// division, the floors, and for power-of-two scales the exact round up (adding the mantissa's all-ones
// carries into the exponent unless the mantissa is zero; inf and NaN are left as they are).
template <class Fmt>
__device__ __forceinline__ float group_scale(float amax) {
  float scale = fmaxf(__fdiv_rn(fmaxf(amax, Fmt::kAmaxFloor), Fmt::kMax), Fmt::kScaleFloor);
  if constexpr (Fmt::kPow2Scales) {
    const uint32_t u = __float_as_uint(scale);
    if (u < 0x7F800000u) scale = __uint_as_float((u + 0x007FFFFFu) & 0xFF800000u);
  }
  return scale;
}

template <typename W>
__device__ __forceinline__ W load_src(const char* p) {
  return __ldg(reinterpret_cast<const W*>(p));  // the source is read-only here and read once
}

// Destination row of this rank's row `row`: dst0 + row, or positions[dst0 + row] in an ordered call.
__device__ __forceinline__ int64_t dest_row(const GatherParams& p, int64_t dst0, int64_t row, const SignalArgs& s,
                                            uint32_t epoch) {
  return p.positions == nullptr ? dst0 + row : position_row(p.positions, p.num_positions, dst0 + row, s, epoch);
}

// Every rank's buffer base, peers first starting after our own rank, ourselves last: the ranks do not
// all start on the same destination. Indexed by unrolled constants only, so it stays in registers.
__device__ __forceinline__ void rotated_bases(const Geometry& g, int rank, int world, char* (&dst)[kMaxWorld]) {
#pragma unroll
  for (int i = 0; i < kMaxWorld; ++i) {
    dst[i] = i < world ? reinterpret_cast<char*>(g.bufs[(rank + 1 + i) % world]) : nullptr;
  }
}

// Rows [first, first + count) of a region of `row_bytes`-byte rows at `base`, every VEC-byte word set
// to `value`, by the whole grid.
template <int VEC>
__device__ __forceinline__ void fill_rows(char* base, int64_t row_bytes, int64_t first, int64_t count,
                                          typename Word<VEC>::type value) {
  using W = typename Word<VEC>::type;
  for (RowChunkCursor c(global_thread(), grid_threads(), row_bytes / VEC); c.row < count; c.advance()) {
    *reinterpret_cast<W*>(base + (first + c.row) * row_bytes + c.chunk * VEC) = value;
  }
}

// Rows of this rank's result (what the caller reads): the ordered output, the compact rows or the
// padded buffer.
__device__ __forceinline__ int64_t result_rows(const GatherParams& p, const Geometry& g, int world) {
  if (p.num_positions >= 0) return p.num_positions;
  if (!p.compact) return world * p.M;
  int64_t total = 0;
  for (int q = 0; q < world; ++q) total += g.counts[q];
  return total;
}

// One block sets `bytes` bytes at `base` to 0xFF: NaN in bf16, fp16, fp32 and float8_e4m3fn alike (the
// result of a call whose ranks disagreed, so that no row of it reads as data). Error path only.
__device__ __forceinline__ void block_fill_nan(char* base, int64_t bytes) {
  if (reinterpret_cast<uintptr_t>(base) % 16 == 0) {
    const uint4 ones = make_uint4(~0u, ~0u, ~0u, ~0u);
    for (int64_t i = threadIdx.x; i < bytes / 16; i += blockDim.x) reinterpret_cast<uint4*>(base)[i] = ones;
    for (int64_t i = bytes / 16 * 16 + threadIdx.x; i < bytes; i += blockDim.x) base[i] = static_cast<char>(0xFF);
  } else {
    for (int64_t i = threadIdx.x; i < bytes; i += blockDim.x) base[i] = static_cast<char>(0xFF);
  }
}

// This launch's fingerprint again, from the staged geometry (the same counts the entry carried): not
// kept in registers across the data movement.
__device__ __forceinline__ CallFingerprint own_fingerprint(const GatherParams& p, const Geometry& g,
                                                           const SignalArgs& s, uint32_t epoch) {
  const int t = static_cast<int>(threadIdx.x);
  return call_fingerprint(t < s.world ? g.counts[t] : 0, s.world, p.M, p.num_positions, p.row_bytes, p.fp_flags,
                          epoch);
}

template <int VEC>
struct CopyStage {
  using Source = CopySource;
  using W = typename Word<VEC>::type;
  static constexpr int kAlign = VEC;

  __device__ static const void* local(const Source& a) { return a.src; }

  // Zero the padding rows [q*M + counts[q], (q+1)*M) of every slot q of our own buffer. Peers write only
  // real rows, so either order against the pushes is correct; the kernel zeroes first, since zeroing
  // after them gained nothing (docs/performance.md, "Figures behind the code's choices").
  __device__ static void zero_padding(const GatherParams& p, const Source&, const Geometry& g, int rank, int world) {
    char* own = reinterpret_cast<char*>(g.bufs[rank]);
    for (int q = 0; q < world; ++q) {
      const int64_t pad_rows = p.M - g.counts[q];
      if (pad_rows > 0) fill_rows<VEC>(own, p.row_bytes, q * p.M + g.counts[q], pad_rows, W{});
    }
  }

  // The result's rows as NaN bytes (one block; after a done-phase fingerprint mismatch).
  __device__ static void poison(const GatherParams& p, const Source&, const Geometry& g, int rank, int world) {
    block_fill_nan(reinterpret_cast<char*>(g.bufs[rank]), result_rows(p, g, world) * p.row_bytes);
  }

  // Load each chunk once, store it `world` times.
  __device__ static void push(const GatherParams& p, const Source& a, const Geometry& g, const SignalArgs& s,
                              uint32_t epoch, int64_t n) {
    const int rank = s.rank, world = s.world;
    const int64_t dst0 = p.compact ? g.offsets[rank] : rank * p.M;
    char* dst[kMaxWorld];
    rotated_bases(g, rank, world, dst);
    RowChunkCursor c(global_thread(), grid_threads(), p.row_bytes / VEC);
    while (c.row < n) {
      W v[kUnroll];
      int64_t off[kUnroll];
      bool has[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        has[u] = c.row < n;
        if (has[u]) {
          v[u] = load_src<W>(a.src + c.row * a.src_stride + c.chunk * VEC);
          off[u] = dest_row(p, dst0, c.row, s, epoch) * p.row_bytes + c.chunk * VEC;
        }
        c.advance();
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (!has[u]) continue;
#pragma unroll
        for (int i = 0; i < kMaxWorld; ++i) {
          if (i < world) *reinterpret_cast<W*>(dst[i] + off[u]) = v[u];
        }
      }
    }
  }
};

template <int D, int K, class Fmt>
struct NormStage {
  using Source = NormSource;
  static constexpr bool FP8 = Fmt::kCode != NoQuant::kCode;
  static constexpr int kAlign = 16;
  static constexpr int E = 16 / Elem<D>::kBytes;      // elements per 16-byte word
  static constexpr int kGroupLanes = FP8 ? Fmt::kGroup / E : 1;  // words, and so lanes, of one group
  static_assert(kDataThreads % 32 == 0 && 32 % kGroupLanes == 0, "a quantization group lies inside one warp");

  __device__ static const void* local(const Source& a) { return a.x; }

  __device__ static void zero_padding(const GatherParams& p, const Source& a, const Geometry& g, int rank,
                                      int world) {
    char* own = reinterpret_cast<char*>(g.bufs[rank]);
    const uint4 zero = make_uint4(0, 0, 0, 0);
    const int64_t scale_row_bytes = a.hidden / Fmt::kGroup * 4;
    const uint32_t pad_scale = __float_as_uint(group_scale<Fmt>(0.f));
    for (int q = 0; q < world; ++q) {
      const int64_t first = q * p.M + g.counts[q], pad_rows = p.M - g.counts[q];
      if (pad_rows <= 0) continue;
      if (!FP8) {
        fill_rows<16>(own, p.row_bytes, first, pad_rows, zero);
        continue;
      }
      fill_rows<16>(own, a.hidden, first, pad_rows, zero);  // q = +0.0 is the zero byte
      if (scale_row_bytes % 16 == 0) {
        fill_rows<16>(own + a.scale_offset, scale_row_bytes, first, pad_rows,
                      make_uint4(pad_scale, pad_scale, pad_scale, pad_scale));
      } else {
        fill_rows<4>(own + a.scale_offset, scale_row_bytes, first, pad_rows, pad_scale);
      }
    }
  }

  __device__ static void poison(const GatherParams& p, const Source& a, const Geometry& g, int rank, int world) {
    char* own = reinterpret_cast<char*>(g.bufs[rank]);
    const int64_t rows = result_rows(p, g, world);
    if (!FP8) {
      block_fill_nan(own, rows * p.row_bytes);
    } else {
      block_fill_nan(own, rows * a.hidden);
      block_fill_nan(own + a.scale_offset, rows * (a.hidden / Fmt::kGroup) * 4);
    }
  }

  __device__ static void push(const GatherParams& p, const Source& a, const Geometry& g, const SignalArgs& s,
                              uint32_t epoch, int64_t n) {
    __shared__ float s_red[2][kDataThreads / 32];  // by row parity: no barrier between one row's reads and the next's writes
    const int t = static_cast<int>(threadIdx.x);
    const int rank = s.rank, world = s.world;
    const int64_t dst0 = p.compact ? g.offsets[rank] : rank * p.M;
    char* dst[kMaxWorld];
    rotated_bases(g, rank, world, dst);
    const int64_t words = a.hidden / E;
    const int64_t groups = a.hidden / Fmt::kGroup;
    int parity = 0;
    for (int64_t row = blockIdx.x; row < n; row += gridDim.x, parity ^= 1) {
      const char* xr = a.x + row * a.x_stride;
      char* rr = a.residual == nullptr ? nullptr : a.residual + row * a.res_stride;
      float v[K][E];
      float ss = 0.f;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t w = t + k * kDataThreads;
        if (w < words) {
          unpack<D>(load_src<uint4>(xr + w * 16), v[k]);
          if (rr != nullptr) add_residual_in_place<D, false>(v[k], rr + w * 16);
#pragma unroll
          for (int e = 0; e < E; ++e) ss = fmaf(v[k][e], v[k][e], ss);
        } else {
#pragma unroll
          for (int e = 0; e < E; ++e) v[k][e] = 0.f;
        }
      }
      float rstd = 1.f;
      if (a.norm) {
        rstd = block_rstd(ss, s_red[parity], a.hidden, a.eps);
      }
      const int64_t drow = dest_row(p, dst0, row, s, epoch);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t w = t + k * kDataThreads;
        const bool has = w < words;
        float y[E];
#pragma unroll
        for (int e = 0; e < E; ++e) {
          y[e] = v[k][e];
          if (a.norm) y[e] = has ? (y[e] * rstd) * load_as_float(a.weight, a.weight_dtype, w * E + e) : 0.f;
        }
        if constexpr (!FP8) {
          if (has) {
            uint4 o;
            pack<D>(y, o);
            const int64_t off = drow * p.row_bytes + w * 16;
#pragma unroll
            for (int i = 0; i < kMaxWorld; ++i) {
              if (i < world) *reinterpret_cast<uint4*>(dst[i] + off) = o;
            }
          }
        } else {
          // Every lane takes part in the group's shuffles (no branch on `has` around them).
          float amax = 0.f;
#pragma unroll
          for (int e = 0; e < E; ++e) {
            y[e] = Elem<D>::to_f(Elem<D>::from_f(y[e]));  // the rows a norm-then-quantize would see
            amax = fmaxf(amax, fabsf(y[e]));
          }
#pragma unroll
          for (int o = kGroupLanes / 2; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
          const float scale = group_scale<Fmt>(amax);
          if (has) {
            uint32_t q[E / 4];
#pragma unroll
            for (int j = 0; j < E / 4; ++j) {
              uint32_t word = 0;
#pragma unroll
              for (int b = 0; b < 4; ++b) {
                const float z = fminf(fmaxf(y[4 * j + b] / scale, -Fmt::kMax), Fmt::kMax);
                word |= static_cast<uint32_t>(__nv_cvt_float_to_fp8(z, __NV_SATFINITE, __NV_E4M3)) << (8 * b);
              }
              q[j] = word;
            }
            const int64_t q_off = drow * a.hidden + w * E;
            const bool leader = (w % kGroupLanes) == 0;
            const int64_t s_off = a.scale_offset + (drow * groups + w / kGroupLanes) * 4;
#pragma unroll
            for (int i = 0; i < kMaxWorld; ++i) {
              if (i >= world) continue;
              if constexpr (E == 8) {
                *reinterpret_cast<uint2*>(dst[i] + q_off) = make_uint2(q[0], q[1]);
              } else {
                *reinterpret_cast<uint32_t*>(dst[i] + q_off) = q[0];
              }
              if (leader) *reinterpret_cast<float*>(dst[i] + s_off) = scale;
            }
          }
        }
      }
    }
  }
};

}  // namespace
}  // namespace nsa_cp
