// p2p_gather: all-gather of uneven shards by pushing this rank's rows straight into every rank's
// (mapped) gather buffer, padded (rank-major, M rows per rank) or compact (offsets) layout.
//
// One launch: (a) "entered" barrier, phase 0: no peer still reads its buffer from the previous call;
// (b) copy our counts[rank] rows from src into every rank's buffer (ourselves included), loading each
// chunk once and storing it world times; (c) padded layout only: zero the padding rows of every slot
// of OUR OWN buffer, so padding never crosses a link (nobody else writes them);
// (d) "done" phase 1: every rank's rows have landed in our buffer.
//
// Double buffering: the caller tags the buffers `bufs` points at (`buffer`, 0 or 1, the same on every
// rank) and keeps, per rank, the tag the previous gather of this channel wrote (`state[0]`, local
// device memory, updated at the end of each launch). When the tags differ, (a) waits for nothing:
// the previous gather's done phase already proved that every peer had entered it, so every peer's
// readers of results older than that (the only ones that can live in this buffer) have finished, and
// no entered signal is sent (every rank decides alike, so nobody waits for it). The decision is made
// on the device because CUDA-graph replays and eager calls interleave without the host seeing them.
//
// (d) goes through the done counters (common.cuh, grid_done_counters): every block reports its own
// rows to every rank, and `state[1]` holds the total this rank has consumed.
//
// Source stages. The kernel above is one template over where a row comes from (`Stage`):
//   * CopyStage<VEC>: the rows of `src` as they are, walked as a grid of (row, VEC-byte chunk) pairs, so
//     any row length keeps every thread busy;
//   * NormStage<D, K, FP8>: one row per block (the RMSNorm needs the whole row): s = x (+ residual) in
//     fp32, residual <- s rounded (in place), y = s * rsqrt(mean(s^2) + eps) * weight in fp32, rounded
//     once, pushed as rows of the dtype, or, FP8, as float8_e4m3fn groups of 128 columns with one fp32
//     scale per group (SGLang's per_token_group_quant_fp8: amax clamped >= 1e-10, scale = amax / 448,
//     q = clamp(y / scale, -448, 448); y is rounded to the dtype before it is quantized). The row lives
//     in registers: K 16-byte words per thread.
// Ordered calls (positions): this rank's compact row i lands at row positions[offsets[rank] + i] of
// the [num_positions] output, instead of row offsets[rank] + i; the destination index is all that
// changes (no extra pass).
//
// FP8 byte layout of a gather buffer of C rows of row_bytes (C = world * rows per rank of that
// buffer): bytes [0, C*H) hold q as [C, H] float8_e4m3fn, row i at i*H; bytes [scale_offset,
// scale_offset + C*(H/128)*4) hold the scales as [C, H/128] float32, scale_offset = C*H rounded up to
// 16. Both blocks are dense, so any first rows of them are contiguous views. Padding rows (padded
// layout, zeroed locally as ever): q = 0, scale = 1e-10/448 (what quantizing a zero row gives).
#include <cuda_fp8.h>

#include "common.cuh"
#include "elem.cuh"
#include "launch.h"
#include "p2p_kernels.h"

namespace nsa_cp {
namespace {

constexpr int kUnroll = 4;  // independent loads in flight per thread (copy stage)

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

template <int D, int K, bool FP8>
struct NormStage {
  using Source = NormSource;
  static constexpr int kAlign = 16;
  static constexpr int E = 16 / Elem<D>::kBytes;      // elements per 16-byte word
  static constexpr int kGroupLanes = kFp8Group / E;   // words, and so lanes, of one fp8 group: 16 or 32
  static_assert(kDataThreads % 32 == 0 && 32 % kGroupLanes == 0, "an fp8 group lies inside one warp");

  __device__ static const void* local(const Source& a) { return a.x; }

  __device__ static void zero_padding(const GatherParams& p, const Source& a, const Geometry& g, int rank,
                                      int world) {
    char* own = reinterpret_cast<char*>(g.bufs[rank]);
    const uint4 zero = make_uint4(0, 0, 0, 0);
    const int64_t scale_row_bytes = a.hidden / kFp8Group * 4;
    const uint32_t pad_scale = __float_as_uint(__fdiv_rn(kFp8AmaxFloor, kFp8Max));
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
      block_fill_nan(own + a.scale_offset, rows * (a.hidden / kFp8Group) * 4);
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
    const int64_t groups = a.hidden / kFp8Group;
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
          const float scale = fmaxf(amax, kFp8AmaxFloor) / kFp8Max;
          if (has) {
            uint32_t q[E / 4];
#pragma unroll
            for (int j = 0; j < E / 4; ++j) {
              uint32_t word = 0;
#pragma unroll
              for (int b = 0; b < 4; ++b) {
                const float z = fminf(fmaxf(y[4 * j + b] / scale, -kFp8Max), kFp8Max);
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

// One block per SM is all a launch asks for (data_blocks <= sm_count; the norm stages hold a row per
// thread in registers): saying so lets ptxas use the registers instead of spilling to local memory.
template <class Stage>
__global__ void __launch_bounds__(kDataThreads, 1)
    p2p_gather_kernel(const GatherParams p, const typename Stage::Source a, const SignalArgs s) {
  __shared__ Geometry g;

  const GeometryEntry entry = load_geometry_entry(p.bufs, p.counts, p.offsets, p.compact, s.world);
  const uint32_t last = ld_relaxed_gpu(p.state);
  const uint32_t epoch = read_epoch(s);
  // (a) Entered: everything earlier on our stream, the readers of our buffer's previous contents
  // included, has completed, so peers may now write into it. Every rank makes the same decision
  // (same calls, same tags), so when we do not wait nobody waits for our signal either.
  const bool wait_entry = last == p.buffer;
  // The call's fingerprint rides on the entry signal when there is one, else on the done counters.
  const bool check = p.fp_flags != 0;
  if (blockIdx.x == 0 && check) {
    publish_fingerprint(s, call_fingerprint(entry.count, s.world, p.M, p.num_positions, p.row_bytes, p.fp_flags, epoch));
  }
  if (blockIdx.x == 0 && wait_entry) block_signal_all(s, 0, epoch);

  const int rank = s.rank, world = s.world;
  const int bad = stage_geometry(g, entry, p.M, p.compact, Stage::kAlign, Stage::local(a), s, epoch,
                                 p.positions == nullptr ? -1 : p.num_positions);
  const int64_t n = g.counts[rank];

  // (c) padding rows of our own buffer
  if (bad < 0 && !p.compact) Stage::zero_padding(p, a, g, rank, world);

  bool ok = bad < 0;
  if (ok && wait_entry) ok = block_wait_all(s, 0, epoch);
  // Every peer's fingerprint is visible after its entry signal: a disagreeing call moves no row.
  if (ok && wait_entry && check) ok = fingerprints_agree(s, own_fingerprint(p, g, s, epoch), 0);

  // (b) push our rows to every rank
  if (ok && n > 0) Stage::push(p, a, g, s, epoch, n);

  // (d) Done: every block reports its rows to every rank; the last block waits for every rank's.
  const int done = grid_done_counters(s, epoch, p.state + 1, !ok);
  if (done == kNotLast) return;
  if (threadIdx.x == 0) *reinterpret_cast<volatile uint32_t*>(p.state) = p.buffer;
  // Without an entry exchange the fingerprints are compared once every peer's counter arrived (their
  // rows have landed): a disagreeing call leaves NaN in our result instead of misplaced rows. (After an
  // entry exchange this compares again and agrees: a disagreement there failed the launch already.
  // Not testing wait_entry here keeps it out of the registers the data movement needs.)
  if (done == kLastAllArrived && p.fp_flags != 0 && !fingerprints_agree(s, own_fingerprint(p, g, s, epoch), 1)) {
    Stage::poison(p, a, g, rank, world);
  }
}

template <int D, bool FP8>
void launch_norm(const GatherParams& p, const NormSource& a, const SignalArgs& s, int words_per_thread,
                 int num_blocks, cudaStream_t st) {
  if (words_per_thread <= 2) {
    p2p_gather_kernel<NormStage<D, 2, FP8>><<<num_blocks, kDataThreads, 0, st>>>(p, a, s);
  } else {
    p2p_gather_kernel<NormStage<D, 4, FP8>><<<num_blocks, kDataThreads, 0, st>>>(p, a, s);
  }
}

template <bool FP8>
void launch_norm_typed(const GatherParams& p, const NormSource& a, const SignalArgs& s, int dtype,
                       int words_per_thread, int num_blocks, cudaStream_t st) {
  switch (dtype) {
    case kBF16:
      launch_norm<kBF16, FP8>(p, a, s, words_per_thread, num_blocks, st);
      break;
    case kFP16:
      launch_norm<kFP16, FP8>(p, a, s, words_per_thread, num_blocks, st);
      break;
    default:
      launch_norm<kFP32, FP8>(p, a, s, words_per_thread, num_blocks, st);
      break;
  }
}

}  // namespace

void enqueue_gather_copy(const GatherParams& p, const CopySource& src, const SignalArgs& s, int vec, int num_blocks,
                         cudaStream_t stream) {
  with_word_width(vec, [&](auto width) {
    p2p_gather_kernel<CopyStage<decltype(width)::value>><<<num_blocks, kDataThreads, 0, stream>>>(p, src, s);
  });
}

void enqueue_gather_norm(const GatherParams& p, const NormSource& src, const SignalArgs& s, int dtype,
                         int words_per_thread, Quant quant, int num_blocks, cudaStream_t stream) {
  if (quant == Quant::kFp8G128) {
    launch_norm_typed<true>(p, src, s, dtype, words_per_thread, num_blocks, stream);
  } else {
    launch_norm_typed<false>(p, src, s, dtype, words_per_thread, num_blocks, stream);
  }
}

void p2p_gather(uint64_t src, int64_t src_row_stride_bytes, int64_t row_bytes, uint64_t bufs, uint64_t counts,
                uint64_t offsets, int64_t max_rank_len, bool compact, int rank, int world, uint64_t pads,
                int channel, uint64_t seq, uint64_t arrive, uint64_t timeout_ns, uint64_t err, int num_blocks,
                uint64_t stream, int buffer, uint64_t state) {
  constexpr const char* fn = "p2p_gather";
  const SignalArgs s =
      make_signal_args(fn, pads, rank, world, channel, seq, arrive, /*need_arrive=*/true, timeout_ns, err);
  require(row_bytes > 0, fn, "row_bytes must be > 0, got " + std::to_string(row_bytes));
  // Any stride >= 0 is safe to read (0 broadcasts one row); only the destination layout is fixed.
  require(src_row_stride_bytes >= 0, fn,
          "src_row_stride_bytes must be >= 0, got " + std::to_string(src_row_stride_bytes));
  require_layout_args(fn, bufs, "bufs (device uint64[world] of gather buffer bases)", counts, offsets, compact,
                      max_rank_len, world, row_bytes, src_row_stride_bytes);
  require_blocks(fn, num_blocks);
  require(buffer == 0 || buffer == 1, fn, "buffer must be 0 or 1, got " + std::to_string(buffer));
  require_ptr(state, fn, "state (device uint32[2], zero-initialised, this rank's gather state)");
  require_done_channel(fn, channel);

  const GatherParams p{row_bytes, as_ptr<const uint64_t>(bufs), as_ptr<const int>(counts), as_ptr<const int>(offsets),
                       max_rank_len, compact, static_cast<uint32_t>(buffer), as_ptr<uint32_t>(state), nullptr, -1};
  const int vec = common_alignment({src, static_cast<uint64_t>(src_row_stride_bytes), static_cast<uint64_t>(row_bytes)});
  enqueue_gather_copy(p, CopySource{as_ptr<const char>(src), src_row_stride_bytes}, s, vec, num_blocks,
                      as_stream(stream));
  check_launch(fn);
}

namespace {
// The norm and fp8 stages of one dtype, 2 and 4 words per thread: "p2p_gather<norm,bf16,2>" and so on.
template <int D>
void append_norm_kernel_info(std::vector<KernelInfo>& out, const std::string& dtype) {
  const std::string norm = "p2p_gather<norm," + dtype, fp8 = "p2p_gather<fp8," + dtype;
  append_kernel_info(out, (norm + ",2>").c_str(), p2p_gather_kernel<NormStage<D, 2, false>>);
  append_kernel_info(out, (norm + ",4>").c_str(), p2p_gather_kernel<NormStage<D, 4, false>>);
  append_kernel_info(out, (fp8 + ",2>").c_str(), p2p_gather_kernel<NormStage<D, 2, true>>);
  append_kernel_info(out, (fp8 + ",4>").c_str(), p2p_gather_kernel<NormStage<D, 4, true>>);
}
}  // namespace

void append_kernel_info_gather(std::vector<KernelInfo>& out) {
  append_kernel_info(out, "p2p_gather<copy16>", p2p_gather_kernel<CopyStage<16>>);
  append_kernel_info(out, "p2p_gather<copy4>", p2p_gather_kernel<CopyStage<4>>);
  append_kernel_info(out, "p2p_gather<copy1>", p2p_gather_kernel<CopyStage<1>>);
  append_norm_kernel_info<kBF16>(out, "bf16");
  append_norm_kernel_info<kFP16>(out, "fp16");
  append_norm_kernel_info<kFP32>(out, "fp32");
}

}  // namespace nsa_cp
