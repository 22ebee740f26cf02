// p2p_reduce_scatter: every rank has written its partial sums for ALL ranks' rows into its own
// (mapped) reduce buffer, padded or compact layout; each rank pulls its own rows from every rank's
// buffer and sums them: out[i, :] = sum_{p = 0..world-1, in that order} bufs[p][src0 + i, :],
// accumulated in fp32 and rounded once on store. The fixed order makes the result independent of
// timing and identical on every run.
//
// One launch: "entered" barrier, phase 0 (every rank's partials are complete); the pull-and-sum;
// "done" barrier, phase 1 (no rank may overwrite its reduce buffer while a peer still reads it).
//
// The norm epilogue (p2p_reduce_scatter_norm_kernel, one row per block): the rounded sum plus the
// residual, the residual updated in place, RMSNorm into out: the reduce-scatter fused with the next
// layer's add + norm.
//
// Ordered calls (positions): the reduce buffers hold [num_positions] rows in batch order; this rank's
// row i is summed from row positions[offsets[rank] + i] of every rank's buffer (the read index is all
// that changes).
#include "geometry.cuh"
#include "elem.cuh"
#include "launch.h"
#include "p2p_kernels.h"

namespace nsa_cp {
namespace {

constexpr int kUnroll = 2;  // rows-chunks per thread per step; each issues `world` loads

// Peer data arrives after the acquire of the entry barrier: plain coherent loads, L2 only (no reuse).
template <typename W>
__device__ __forceinline__ W load_peer(const char* p) {
  return __ldcg(reinterpret_cast<const W*>(p));
}

// This launch's fingerprint again, from the staged geometry (what the entry carried).
__device__ __forceinline__ CallFingerprint own_fingerprint(const ReduceParams& p, const Geometry& g,
                                                           const SignalArgs& s, uint32_t epoch) {
  const int t = static_cast<int>(threadIdx.x);
  return call_fingerprint(t < s.world ? g.counts[t] : 0, s.world, p.M, p.num_positions, p.row_bytes, p.fp_flags,
                          epoch);
}

// The entry phase both kernels share. Block 0 signals every rank that this rank entered: our partials
// (written earlier on our stream) are complete and may be read by peers; the call's fingerprint rides
// on that signal (common.cuh). Then every block stages the geometry (`local`: this rank's output, null
// only without rows; `vec`: its alignment), waits for every rank's entry and compares their
// fingerprints. Returns whether this rank's rows may be read (false: no row of the call is read), and
// the peers' reduce buffers in `src`.
__device__ __forceinline__ bool enter(const ReduceParams& p, const SignalArgs& s, Geometry& g, uint32_t epoch, int vec,
                                      const void* local, const char* (&src)[kMaxWorld]) {
  const GeometryEntry entry = load_geometry_entry(p.bufs, p.counts, p.offsets, p.compact, s.world);
  if (blockIdx.x == 0) {
    if (p.fp_flags != 0) {
      publish_fingerprint(s, call_fingerprint(entry.count, s.world, p.M, p.num_positions, p.row_bytes, p.fp_flags,
                                              epoch));
    }
    block_signal_all(s, 0, epoch);
  }
  const int bad = stage_geometry(g, entry, p.M, p.compact, vec, local, s, epoch,
                                 p.positions == nullptr ? -1 : p.num_positions);
  bool ok = bad < 0;
  if (ok) ok = block_wait_all(s, 0, epoch);
  if (ok && p.fp_flags != 0) ok = fingerprints_agree(s, own_fingerprint(p, g, s, epoch), 0);
#pragma unroll
  for (int q = 0; q < kMaxWorld; ++q) src[q] = q < s.world ? reinterpret_cast<const char*>(g.bufs[q]) : nullptr;
  return ok;
}

template <int D, bool VECTOR>
__global__ void __launch_bounds__(kDataThreads) p2p_reduce_scatter_kernel(const ReduceParams p, const SignalArgs s) {
  constexpr int kWordBytes = VECTOR ? 16 : Elem<D>::kBytes;
  constexpr int kElems = kWordBytes / Elem<D>::kBytes;
  using W = typename Word<kWordBytes>::type;
  __shared__ Geometry g;

  const uint32_t epoch = read_epoch(s);
  const char* src[kMaxWorld];
  const bool ok = enter(p, s, g, epoch, kWordBytes, p.out, src);
  const int rank = s.rank, world = s.world;
  const int64_t n = g.counts[rank];

  if (ok && n > 0) {
    const int64_t src0 = p.compact ? g.offsets[rank] : rank * p.M;
    RowChunkCursor c(global_thread(), grid_threads(), p.row_bytes / kWordBytes);
    while (c.row < n) {
      W x[kUnroll][kMaxWorld];
      int64_t in_off[kUnroll], out_off[kUnroll];
      bool has[kUnroll];
      // Issue every load of this step before the first use.
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        has[u] = c.row < n;
        const int64_t src_row = p.positions == nullptr || !has[u]
                                    ? src0 + c.row
                                    : position_row(p.positions, p.num_positions, src0 + c.row, s, epoch);
        in_off[u] = src_row * p.row_bytes + c.chunk * kWordBytes;
        out_off[u] = c.row * p.out_stride + c.chunk * kWordBytes;
#pragma unroll
        for (int q = 0; q < kMaxWorld; ++q) {
          if (has[u] && q < world) x[u][q] = load_peer<W>(src[q] + in_off[u]);
        }
        c.advance();
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (!has[u]) continue;
        float acc[kElems];
        unpack<D>(x[u][0], acc);
#pragma unroll
        for (int q = 1; q < kMaxWorld; ++q) {
          if (q < world) {
            float v[kElems];
            unpack<D>(x[u][q], v);
#pragma unroll
            for (int e = 0; e < kElems; ++e) acc[e] += v[e];
          }
        }
        W r;
        pack<D>(acc, r);
        *reinterpret_cast<W*>(p.out + out_off[u]) = r;
      }
    }
  }

  grid_done_barrier(s, epoch, !ok);
}

// The same protocol as above; the data movement one row per block: every word of the row is pulled
// from every rank and summed (rank order, fp32), rounded to the dtype, then the add + RMSNorm epilogue
// (p2p_kernels.h, NormEpilogue) writes the residual and the normed row.
template <int D, int K>
__global__ void __launch_bounds__(kDataThreads)
    p2p_reduce_scatter_norm_kernel(const ReduceParams p, const NormEpilogue ep, const SignalArgs s) {
  constexpr int E = 16 / Elem<D>::kBytes;
  __shared__ Geometry g;
  __shared__ float s_red[2][kDataThreads / 32];

  const uint32_t epoch = read_epoch(s);
  const char* src[kMaxWorld];
  // this rank's rows need both an output and a residual (either may be null only without rows)
  const bool ok = enter(p, s, g, epoch, 16, ep.residual == nullptr ? nullptr : p.out, src);
  const int rank = s.rank, world = s.world;
  const int64_t n = g.counts[rank];

  if (ok && n > 0) {
    const int64_t src0 = p.compact ? g.offsets[rank] : rank * p.M;
    const int t = static_cast<int>(threadIdx.x);
    const int64_t words = ep.hidden / E;
    int parity = 0;
    for (int64_t row = blockIdx.x; row < n; row += gridDim.x, parity ^= 1) {
      const int64_t src_row =
          p.positions == nullptr ? src0 + row : position_row(p.positions, p.num_positions, src0 + row, s, epoch);
      char* rr = ep.residual + row * ep.res_stride;
      float v[K][E];
      float ss = 0.f;
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t w = t + k * kDataThreads;
        if (w < words) {
          const int64_t off = src_row * p.row_bytes + w * 16;
          uint4 x[kMaxWorld];
#pragma unroll
          for (int q = 0; q < kMaxWorld; ++q) {
            if (q < world) x[q] = load_peer<uint4>(src[q] + off);
          }
          unpack<D>(x[0], v[k]);
#pragma unroll
          for (int q = 1; q < kMaxWorld; ++q) {
            if (q < world) {
              float f[E];
              unpack<D>(x[q], f);
#pragma unroll
              for (int e = 0; e < E; ++e) v[k][e] += f[e];
            }
          }
          add_residual_in_place<D, true>(v[k], rr + w * 16);  // the reduce-scatter's rounded rows + residual
#pragma unroll
          for (int e = 0; e < E; ++e) ss = fmaf(v[k][e], v[k][e], ss);
        } else {
#pragma unroll
          for (int e = 0; e < E; ++e) v[k][e] = 0.f;
        }
      }
      const float rstd = block_rstd(ss, s_red[parity], ep.hidden, ep.eps);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        const int64_t w = t + k * kDataThreads;
        if (w >= words) continue;
        float y[E];
#pragma unroll
        for (int e = 0; e < E; ++e) y[e] = (v[k][e] * rstd) * load_as_float(ep.weight, ep.weight_dtype, w * E + e);
        uint4 o;
        pack<D>(y, o);
        *reinterpret_cast<uint4*>(p.out + row * p.out_stride + w * 16) = o;
      }
    }
  }

  grid_done_barrier(s, epoch, !ok);
}

template <int D>
void launch_norm_typed(const ReduceParams& p, const NormEpilogue& e, const SignalArgs& s, int words_per_thread,
                       int num_blocks, cudaStream_t st) {
  if (words_per_thread <= 2) {
    p2p_reduce_scatter_norm_kernel<D, 2><<<num_blocks, kDataThreads, 0, st>>>(p, e, s);
  } else {
    p2p_reduce_scatter_norm_kernel<D, 4><<<num_blocks, kDataThreads, 0, st>>>(p, e, s);
  }
}

template <int D>
void launch_typed(const ReduceParams& p, const SignalArgs& s, bool vector, int num_blocks, cudaStream_t st) {
  if (vector) {
    p2p_reduce_scatter_kernel<D, true><<<num_blocks, kDataThreads, 0, st>>>(p, s);
  } else {
    p2p_reduce_scatter_kernel<D, false><<<num_blocks, kDataThreads, 0, st>>>(p, s);
  }
}

}  // namespace

void enqueue_reduce_scatter(const ReduceParams& p, const SignalArgs& s, int dtype, bool vector, int num_blocks,
                            cudaStream_t st) {
  switch (dtype) {
    case kBF16:
      launch_typed<kBF16>(p, s, vector, num_blocks, st);
      break;
    case kFP16:
      launch_typed<kFP16>(p, s, vector, num_blocks, st);
      break;
    default:
      launch_typed<kFP32>(p, s, vector, num_blocks, st);
      break;
  }
}

void enqueue_reduce_scatter_norm(const ReduceParams& p, const NormEpilogue& e, const SignalArgs& s, int dtype,
                                 int words_per_thread, int num_blocks, cudaStream_t st) {
  switch (dtype) {
    case kBF16:
      launch_norm_typed<kBF16>(p, e, s, words_per_thread, num_blocks, st);
      break;
    case kFP16:
      launch_norm_typed<kFP16>(p, e, s, words_per_thread, num_blocks, st);
      break;
    default:
      launch_norm_typed<kFP32>(p, e, s, words_per_thread, num_blocks, st);
      break;
  }
}

void p2p_reduce_scatter(uint64_t out, int64_t out_row_stride_bytes, uint64_t bufs, uint64_t counts,
                        uint64_t offsets, int64_t max_rank_len, bool compact, int64_t hidden, int dtype, int rank,
                        int world, uint64_t pads, int channel, uint64_t seq, uint64_t arrive, uint64_t timeout_ns,
                        uint64_t err, int num_blocks, uint64_t stream) {
  constexpr const char* fn = "p2p_reduce_scatter";
  const SignalArgs s =
      make_signal_args(fn, pads, rank, world, channel, seq, arrive, /*need_arrive=*/true, timeout_ns, err);
  require(dtype == kBF16 || dtype == kFP16 || dtype == kFP32, fn,
          "dtype must be 0 (bfloat16), 1 (float16) or 2 (float32), got " + std::to_string(dtype));
  require(hidden > 0 && hidden <= (int64_t{1} << 40), fn, "hidden must be in [1, 2^40], got " + std::to_string(hidden));
  const int64_t elem = dtype == kFP32 ? 4 : 2;
  const int64_t row_bytes = hidden * elem;
  require(out_row_stride_bytes >= row_bytes, fn,
          "out_row_stride_bytes (" + std::to_string(out_row_stride_bytes) + ") must be >= hidden * element size (" +
              std::to_string(row_bytes) + ")");
  require(out_row_stride_bytes % elem == 0, fn,
          "out_row_stride_bytes must be a multiple of the element size (" + std::to_string(elem) + ")");
  require(out % elem == 0, fn, "out must be aligned to the element size (" + std::to_string(elem) + ")");
  require_layout_args(fn, bufs, "bufs (device uint64[world] of reduce buffer bases)", counts, offsets, compact,
                      max_rank_len, world, row_bytes, out_row_stride_bytes);
  require_blocks(fn, num_blocks);

  const ReduceParams p{as_ptr<char>(out), out_row_stride_bytes, row_bytes, as_ptr<const uint64_t>(bufs),
                       as_ptr<const int>(counts), as_ptr<const int>(offsets), max_rank_len, compact, nullptr, -1};
  const bool vector =
      common_alignment({out, static_cast<uint64_t>(out_row_stride_bytes), static_cast<uint64_t>(row_bytes)}) == 16;
  enqueue_reduce_scatter(p, s, dtype, vector, num_blocks, as_stream(stream));
  check_launch(fn);
}

void append_kernel_info_reduce_scatter(std::vector<KernelInfo>& out) {
  append_kernel_info(out, "p2p_reduce_scatter<bf16,vec16>", p2p_reduce_scatter_kernel<kBF16, true>);
  append_kernel_info(out, "p2p_reduce_scatter<bf16,scalar>", p2p_reduce_scatter_kernel<kBF16, false>);
  append_kernel_info(out, "p2p_reduce_scatter<fp16,vec16>", p2p_reduce_scatter_kernel<kFP16, true>);
  append_kernel_info(out, "p2p_reduce_scatter<fp16,scalar>", p2p_reduce_scatter_kernel<kFP16, false>);
  append_kernel_info(out, "p2p_reduce_scatter<fp32,vec16>", p2p_reduce_scatter_kernel<kFP32, true>);
  append_kernel_info(out, "p2p_reduce_scatter<fp32,scalar>", p2p_reduce_scatter_kernel<kFP32, false>);
  append_kernel_info(out, "p2p_reduce_scatter<norm,bf16,2>", p2p_reduce_scatter_norm_kernel<kBF16, 2>);
  append_kernel_info(out, "p2p_reduce_scatter<norm,bf16,4>", p2p_reduce_scatter_norm_kernel<kBF16, 4>);
  append_kernel_info(out, "p2p_reduce_scatter<norm,fp16,2>", p2p_reduce_scatter_norm_kernel<kFP16, 2>);
  append_kernel_info(out, "p2p_reduce_scatter<norm,fp16,4>", p2p_reduce_scatter_norm_kernel<kFP16, 4>);
  append_kernel_info(out, "p2p_reduce_scatter<norm,fp32,2>", p2p_reduce_scatter_norm_kernel<kFP32, 2>);
  append_kernel_info(out, "p2p_reduce_scatter<norm,fp32,4>", p2p_reduce_scatter_norm_kernel<kFP32, 4>);
}

}  // namespace nsa_cp
