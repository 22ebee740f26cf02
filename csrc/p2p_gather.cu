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
#include "common.cuh"
#include "launch.h"

namespace nsa_cp {
namespace {

constexpr int kUnroll = 4;  // independent loads in flight per thread

struct GatherParams {
  const char* src;
  int64_t src_stride;  // bytes
  int64_t row_bytes;   // bytes per row, also the row stride of every gather buffer
  const uint64_t* bufs;
  const int* counts;
  const int* offsets;  // compact only
  int64_t M;           // max_rank_len (padded layout)
  bool compact;
  uint32_t buffer;  // tag of the buffers `bufs` points at
  uint32_t* state;  // local uint32[2]: [0] tag the previous gather wrote, [1] done-counter total consumed
};

template <typename W>
__device__ __forceinline__ W load_src(const char* p) {
  return __ldg(reinterpret_cast<const W*>(p));  // src is read-only here and read once
}

template <int VEC>
__global__ void __launch_bounds__(kDataThreads) p2p_gather_kernel(const GatherParams p, const SignalArgs s) {
  using W = typename Word<VEC>::type;
  __shared__ Geometry g;

  const GeometryEntry entry = load_geometry_entry(p.bufs, p.counts, p.offsets, p.compact, s.world);
  const uint32_t last = ld_relaxed_gpu(p.state);
  const uint32_t epoch = read_epoch(s);
  // (a) Entered: everything earlier on our stream, the readers of our buffer's previous contents
  // included, has completed, so peers may now write into it. Every rank makes the same decision
  // (same calls, same tags), so when we do not wait nobody waits for our signal either.
  const bool wait_entry = last == p.buffer;
  if (blockIdx.x == 0 && wait_entry) block_signal_all(s, 0, epoch);

  const int rank = s.rank, world = s.world;
  const int bad = stage_geometry(g, entry, p.M, p.compact, VEC, p.src, s, epoch);
  const int64_t n = g.counts[rank];

  const int64_t chunks = p.row_bytes / VEC;

  // (c) Zero the padding rows [q*M + counts[q], (q+1)*M) of every slot q of our own buffer. (Here,
  // not after the pushes: that measured no faster on 2x H200, runs 17 and 21 of docs/gpu_runs.md.)
  if (bad < 0 && !p.compact) {
    char* own = reinterpret_cast<char*>(g.bufs[rank]);
    for (int q = 0; q < world; ++q) {
      const int64_t first = q * p.M + g.counts[q];
      const int64_t pad_rows = p.M - g.counts[q];
      if (pad_rows <= 0) continue;
      for (RowChunkCursor c(global_thread(), grid_threads(), chunks); c.row < pad_rows; c.advance()) {
        *reinterpret_cast<W*>(own + (first + c.row) * p.row_bytes + c.chunk * VEC) = W{};
      }
    }
  }

  bool ok = bad < 0;
  if (ok && wait_entry) ok = block_wait_all(s, 0, epoch);

  // (b) Push our rows to every rank.
  if (ok && n > 0) {
    const int64_t dst0 = p.compact ? g.offsets[rank] : rank * p.M;
    // Peers first, starting after our own rank, ourselves last: the ranks do not all start on the
    // same destination. Indexed by unrolled constants only, so it stays in registers.
    char* dst[kMaxWorld];
#pragma unroll
    for (int i = 0; i < kMaxWorld; ++i) {
      dst[i] = i < world ? reinterpret_cast<char*>(g.bufs[(rank + 1 + i) % world]) + dst0 * p.row_bytes : nullptr;
    }
    RowChunkCursor c(global_thread(), grid_threads(), chunks);
    while (c.row < n) {
      W v[kUnroll];
      int64_t off[kUnroll];
      bool has[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        has[u] = c.row < n;
        off[u] = c.row * p.row_bytes + c.chunk * VEC;
        if (has[u]) v[u] = load_src<W>(p.src + c.row * p.src_stride + c.chunk * VEC);
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

  // (d) Done: every block reports its rows to every rank; the last block waits for every rank's.
  if (grid_done_counters(s, epoch, p.state + 1, !ok) && threadIdx.x == 0) {
    *reinterpret_cast<volatile uint32_t*>(p.state) = p.buffer;
  }
}

}  // namespace

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
  require(kDoneBase + (channel + 1) * kMaxWorld <= kSignalWords, fn,
          "channel must be < " + std::to_string((kSignalWords - kDoneBase) / kMaxWorld) +
              " (the pad's done counters), got " + std::to_string(channel));

  const GatherParams p{as_ptr<const char>(src), src_row_stride_bytes, row_bytes,  as_ptr<const uint64_t>(bufs),
                       as_ptr<const int>(counts), as_ptr<const int>(offsets), max_rank_len, compact,
                       static_cast<uint32_t>(buffer),    as_ptr<uint32_t>(state)};
  const int vec = common_alignment({src, static_cast<uint64_t>(src_row_stride_bytes), static_cast<uint64_t>(row_bytes)});
  with_word_width(vec, [&](auto width) {
    p2p_gather_kernel<decltype(width)::value><<<num_blocks, kDataThreads, 0, as_stream(stream)>>>(p, s);
  });
  check_launch(fn);
}

void append_kernel_info_gather(std::vector<KernelInfo>& out) {
  append_kernel_info(out, "p2p_gather<16>", p2p_gather_kernel<16>);
  append_kernel_info(out, "p2p_gather<4>", p2p_gather_kernel<4>);
  append_kernel_info(out, "p2p_gather<1>", p2p_gather_kernel<1>);
}

}  // namespace nsa_cp
