// p2p_gather_ll: the all-gather of small layouts with flags in-band with the data (the "LL128" idea of
// NCCL), so that no separate done signal, and no system fence before it, sits between a rank's last
// store and its peer's last read.
//
// Wire format. A row of row_bytes (a multiple of 8) travels as lines_per_row = ceil(row_bytes / 120)
// lines of 128 bytes: eight lanes of one warp store one line with one 16-byte vector store each; lanes
// 0..6 carry bytes [16*lane, 16*lane + 16) of the line's 120 data bytes, lane 7 carries bytes
// [112, 120) and then the 8-byte flag kFlagData | epoch. The receiver's eight lanes load the line with
// one 16-byte vector load each (one warp instruction) and take it when lane 7 sees the flag. That
// relies on a 128-byte line written by one warp store instruction over NVLink becoming visible as a
// whole to one warp load instruction of the same line: not a promise of the PTX memory model, but the
// hardware property NCCL's LL128 protocol is built on, and NCCL enables LL128 over NVLink on sm_90.
// The transport only takes this path for layouts of at most `ll_tokens` rows per rank, and the sm
// push kernel (p2p_gather.cu), which needs no such property, serves everything else.
//
// Staging. Every rank owns a symmetric staging area of [2 parities][world sources][slot_lines][128 B];
// a call of epoch e sends into parity e & 1 of every peer, slot [e & 1][our rank]. Reuse is safe
// without any barrier: a rank writes parity p in call e only after it has finished call e - 1, and
// finishing call e - 1 needed a line of call e - 1 from every peer, which the peer sends only after it
// finished call e - 2, the last reader of parity p. Every call of the channel counts here (the sm and
// copy-engine gathers, the transport barrier): each one hears from every peer. A rank with no rows
// still sends one line (its presence), so that holds for zero-token ranks too.
//
// The output is this rank's own gather buffer, written only by this rank (padded or compact layout,
// padding rows zeroed): peers never write into it, so it needs no entry barrier either. `state[0]`
// records the buffer tag written, as the sm kernel does; the call proves, as a done phase would, that
// every peer entered it (double buffering's argument in p2p_gather.cu holds after it).
//
// Faults. A receiver that waits longer than timeout_ns records a timeout of this call (phase 1, the
// peer) and stops receiving. A rank whose device-side geometry is bad moves no rows and writes the
// abort flag kFlagAbort | epoch into every line a peer could wait for (the first max(1, M *
// lines_per_row) of its slot), so the peers stop too and record the bad geometry of that rank.
#include "common.cuh"
#include "launch.h"

namespace nsa_cp {
namespace {

constexpr int kLineBytes = 128;
constexpr int kLineDataBytes = 120;
constexpr int kLanesPerLine = 8;
constexpr int kLinesPerWarp = 32 / kLanesPerLine;
constexpr int kSendUnroll = 4;  // lines per lane group with loads in flight together
constexpr int kRecvUnroll = 4;  // lines per lane group polled together
constexpr uint64_t kFlagData = 1ull << 32;   // never 0, the staging area's initial contents
constexpr uint64_t kFlagAbort = 2ull << 32;
constexpr uint32_t kFull = 0xffffffffu;

struct LLParams {
  const char* src;
  int64_t src_stride;  // bytes
  int64_t row_bytes;   // multiple of 8; also the row stride of the output
  char* out;           // this rank's gather buffer (local)
  const uint64_t* stages;
  const int* counts;
  const int* offsets;  // compact only
  int64_t M;
  int64_t slot_lines;  // lines per [parity][source] slot of every staging area
  int lines_per_row;
  bool compact;
  uint32_t buffer;
  uint32_t* state;  // local uint32[2]; [0] = tag of the buffer the last gather wrote
};

// One lane's 16 bytes of a line, stored or loaded by one instruction, predicated inside the asm so that
// the eight lanes of a line always issue it together (the caller keeps the warp converged).
__device__ __forceinline__ void st_line_part(char* p, uint64_t a, uint64_t b, bool on) {
  asm volatile(
      "{.reg .pred q; setp.ne.b32 q, %3, 0; @q st.volatile.global.v2.u64 [%0], {%1, %2};}" ::"l"(p), "l"(a), "l"(b),
      "r"(static_cast<int>(on))
      : "memory");
}

__device__ __forceinline__ void ld_line_part(const char* p, uint64_t& a, uint64_t& b, bool on) {
  asm volatile("{.reg .pred q; setp.ne.b32 q, %3, 0; @q ld.volatile.global.v2.u64 {%0, %1}, [%2];}"
               : "+l"(a), "+l"(b)
               : "l"(p), "r"(static_cast<int>(on))
               : "memory");
}

// Where lane `sub` (0..7) of line j of a row keeps its data: byte offset in the row of its first word;
// lanes 0..6 have two words, lane 7 one (its second is the flag).
__device__ __forceinline__ int64_t lane_offset(int64_t j, int sub) { return j * kLineDataBytes + sub * 16; }

// Writes lane `sub`'s words of line j of `row` (a dense row of row_bytes) from (a, b).
__device__ __forceinline__ void store_row_words(char* row, int64_t row_bytes, int64_t j, int sub, uint64_t a,
                                                uint64_t b) {
  const int64_t off = lane_offset(j, sub);
  if (off < row_bytes) *reinterpret_cast<uint64_t*>(row + off) = a;
  if (sub < kLanesPerLine - 1 && off + 8 < row_bytes) *reinterpret_cast<uint64_t*>(row + off + 8) = b;
}

__device__ __forceinline__ int64_t lines_of(int rows, int lines_per_row) {
  return rows > 0 ? static_cast<int64_t>(rows) * lines_per_row : 1;  // a rank without rows sends its presence
}

__global__ void __launch_bounds__(kDataThreads) p2p_gather_ll_kernel(const LLParams p, const SignalArgs s) {
  __shared__ Geometry g;
  __shared__ int s_last;

  const GeometryEntry entry = load_geometry_entry(p.stages, p.counts, p.offsets, p.compact, s.world);
  const uint32_t epoch = read_epoch(s);
  const int rank = s.rank, world = s.world;
  const int bad = stage_geometry(g, entry, p.M, p.compact, kLineBytes, p.src, s, epoch);

  const int lane = static_cast<int>(threadIdx.x & 31), sub = lane & (kLanesPerLine - 1);
  const int64_t warp = global_thread() / 32, warps = grid_threads() / 32;
  const int64_t group_in_warp = lane / kLanesPerLine;
  const int64_t lpr = p.lines_per_row;
  const uint32_t parity = epoch & 1u;
  const uint64_t flag = (bad < 0 ? kFlagData : kFlagAbort) | epoch;
  // slot [parity][src] of the staging area at `base`
  auto slot = [&](uint64_t base, int src) {
    return reinterpret_cast<char*>(base) + ((static_cast<int64_t>(parity) * world + src) * p.slot_lines) * kLineBytes;
  };

  // (1) Send: our rows to every peer's staging slot, and into our own gather buffer. Bad geometry:
  // no rows, the abort flag in every line a peer may wait for.
  const int n = bad < 0 ? g.counts[rank] : 0;
  const int64_t send_lines = bad < 0 ? lines_of(n, p.lines_per_row) : lines_of(static_cast<int>(p.M), p.lines_per_row);
  const int64_t own0 = p.compact ? g.offsets[rank] : rank * p.M;
  __syncwarp();
  for (int64_t base = warp * kLinesPerWarp; base < send_lines; base += warps * kLinesPerWarp * kSendUnroll) {
    uint64_t a[kSendUnroll], b[kSendUnroll];
    int64_t line[kSendUnroll];
#pragma unroll
    for (int u = 0; u < kSendUnroll; ++u) {
      line[u] = base + u * warps * kLinesPerWarp + group_in_warp;
      a[u] = 0;
      b[u] = 0;
      if (line[u] < send_lines && line[u] < n * lpr) {
        const int64_t r = line[u] / lpr, j = line[u] - r * lpr, off = lane_offset(j, sub);
        const char* row = p.src + r * p.src_stride;
        if (off < p.row_bytes) a[u] = __ldg(reinterpret_cast<const uint64_t*>(row + off));
        if (sub < kLanesPerLine - 1 && off + 8 < p.row_bytes) b[u] = __ldg(reinterpret_cast<const uint64_t*>(row + off + 8));
      }
      if (sub == kLanesPerLine - 1) b[u] = flag;
    }
    __syncwarp();  // the eight lanes of a line store it with one instruction
#pragma unroll
    for (int u = 0; u < kSendUnroll; ++u) {
      const bool has = line[u] < send_lines;
      for (int i = 1; i < world; ++i) {
        const int peer = (rank + i) % world;
        // a bad geometry may be a bad staging address: nothing goes through that one
        const bool usable = g.bufs[peer] != 0 && g.bufs[peer] % kLineBytes == 0;
        st_line_part(slot(g.bufs[peer], rank) + line[u] * kLineBytes + sub * 16, a[u], b[u], has && usable);
      }
      if (has && line[u] < n * lpr) {
        const int64_t r = line[u] / lpr;
        store_row_words(p.out + (own0 + r) * p.row_bytes, p.row_bytes, line[u] - r * lpr, sub, a[u], b[u]);
      }
    }
  }

  // (2) Padded layout: zero the padding rows of every slot of our own buffer (8-byte words).
  if (bad < 0 && !p.compact) {
    const int64_t words = p.row_bytes / 8;
    for (int q = 0; q < world; ++q) {
      const int64_t first = q * p.M + g.counts[q];
      const int64_t pad_rows = p.M - g.counts[q];
      for (RowChunkCursor c(global_thread(), grid_threads(), words); c.row < pad_rows; c.advance()) {
        reinterpret_cast<uint64_t*>(p.out + (first + c.row) * p.row_bytes)[c.chunk] = 0;
      }
    }
  }

  // (3) Receive every peer's lines from our staging area into our buffer. The loop bounds are
  // warp-uniform, so the eight lanes of a line load it together.
  bool dead = bad >= 0;  // warp-uniform: our geometry is bad, or a wait of this warp timed out
  const uint64_t want = kFlagData | epoch, abort = kFlagAbort | epoch;
  for (int i = 1; i < world && !dead; ++i) {
    const int q = (rank + i) % world;
    const int nq = g.counts[q];
    const int64_t lines = lines_of(nq, p.lines_per_row);
    const char* in = slot(g.bufs[rank], q);
    const int64_t dst0 = p.compact ? g.offsets[q] : q * p.M;
    for (int64_t base = warp * kLinesPerWarp; base < lines && !dead; base += warps * kLinesPerWarp * kRecvUnroll) {
      uint64_t a[kRecvUnroll], b[kRecvUnroll];
      int64_t line[kRecvUnroll];
      bool ready[kRecvUnroll];  // the same on the eight lanes of a line
      bool aborted = false;
#pragma unroll
      for (int u = 0; u < kRecvUnroll; ++u) {
        line[u] = base + u * warps * kLinesPerWarp + group_in_warp;
        a[u] = 0;
        b[u] = 0;
        ready[u] = line[u] >= lines;
      }
      uint64_t start = 0;
      while (true) {
        __syncwarp();
#pragma unroll
        for (int u = 0; u < kRecvUnroll; ++u) ld_line_part(in + line[u] * kLineBytes + sub * 16, a[u], b[u], !ready[u]);
        bool all = true;
#pragma unroll
        for (int u = 0; u < kRecvUnroll; ++u) {
          // lane 7 holds the flag: 0 not yet, 1 data, 2 abort; its verdict goes to its line's lanes
          const int verdict = __shfl_sync(kFull, b[u] == want ? 1 : (b[u] == abort ? 2 : 0), lane | 7);
          if (!ready[u]) {
            ready[u] = verdict != 0;
            aborted |= verdict == 2;
          }
          all &= ready[u];
        }
        if (__all_sync(kFull, all)) break;
        if (s.timeout_ns) {
          const uint64_t now = globaltimer_ns();
          if (start == 0) start = now;
          if (__shfl_sync(kFull, now - start > s.timeout_ns, 0)) {
            if (lane == 0) {
              record_error(s.err, kErrTimeout, static_cast<uint32_t>(s.channel * 2 + 1), static_cast<uint32_t>(q),
                           epoch);
            }
            dead = true;
            break;
          }
        }
      }
      if (__any_sync(kFull, aborted)) {
        if (lane == 0) {
          record_error(s.err, kErrBadDeviceArg, static_cast<uint32_t>(s.channel * 2 + 1), static_cast<uint32_t>(q),
                       epoch);
        }
        dead = true;
      }
      if (dead) break;
#pragma unroll
      for (int u = 0; u < kRecvUnroll; ++u) {
        if (line[u] < static_cast<int64_t>(nq) * lpr) {
          const int64_t r = line[u] / lpr;
          store_row_words(p.out + (dst0 + r) * p.row_bytes, p.row_bytes, line[u] - r * lpr, sub, a[u], b[u]);
        }
      }
    }
  }

  // (4) The last block to finish publishes the epoch and the buffer written (every block has read both).
  __syncthreads();
  if (threadIdx.x == 0) s_last = atomicAdd(s.arrive, 1u) + 1u == gridDim.x;
  __syncthreads();
  if (s_last && threadIdx.x == 0) {
    *s.arrive = 0;
    *reinterpret_cast<volatile uint32_t*>(p.state) = p.buffer;
    *reinterpret_cast<volatile uint32_t*>(s.seq) = epoch;
  }
}

}  // namespace

void p2p_gather_ll(uint64_t src, int64_t src_row_stride_bytes, int64_t row_bytes, uint64_t out, uint64_t stages,
                   int64_t stage_rows, uint64_t counts, uint64_t offsets, int64_t max_rank_len, bool compact, int rank,
                   int world, uint64_t pads, int channel, uint64_t seq, uint64_t arrive, uint64_t timeout_ns,
                   uint64_t err, int num_blocks, uint64_t stream, int buffer, uint64_t state) {
  constexpr const char* fn = "p2p_gather_ll";
  const SignalArgs s =
      make_signal_args(fn, pads, rank, world, channel, seq, arrive, /*need_arrive=*/true, timeout_ns, err);
  require(row_bytes > 0 && row_bytes % 8 == 0, fn,
          "row_bytes must be a positive multiple of 8 (8-byte words), got " + std::to_string(row_bytes));
  require(src_row_stride_bytes >= 0 && src_row_stride_bytes % 8 == 0, fn,
          "src_row_stride_bytes must be a multiple of 8 and >= 0, got " + std::to_string(src_row_stride_bytes));
  require(src % 8 == 0, fn, "src must be 8-byte aligned (or 0 without rows), got " + std::to_string(src));
  require(out != 0 && out % 8 == 0, fn, "out (this rank's gather buffer) must be a non-null 8-byte aligned device pointer");
  require_layout_args(fn, stages, "stages (device uint64[world] of staging area bases)", counts, offsets, compact,
                      max_rank_len, world, row_bytes, src_row_stride_bytes);
  require(stage_rows >= 1 && stage_rows >= max_rank_len, fn,
          "stage_rows must be >= 1 and >= max_rank_len (" + std::to_string(max_rank_len) + "), got " +
              std::to_string(stage_rows));
  const int64_t lines_per_row = (row_bytes + kLineDataBytes - 1) / kLineDataBytes;
  require(stage_rows <= INT32_MAX / lines_per_row, fn, "stage_rows * lines per row must fit int32");
  require_blocks(fn, num_blocks);
  require(buffer == 0 || buffer == 1, fn, "buffer must be 0 or 1, got " + std::to_string(buffer));
  require_ptr(state, fn, "state (device uint32[2], zero-initialised, this rank's gather state)");

  const LLParams p{as_ptr<const char>(src), src_row_stride_bytes, row_bytes, as_ptr<char>(out),
                   as_ptr<const uint64_t>(stages), as_ptr<const int>(counts), as_ptr<const int>(offsets),
                   max_rank_len, stage_rows * lines_per_row, static_cast<int>(lines_per_row), compact,
                   static_cast<uint32_t>(buffer), as_ptr<uint32_t>(state)};
  p2p_gather_ll_kernel<<<num_blocks, kDataThreads, 0, as_stream(stream)>>>(p, s);
  check_launch(fn);
}

void append_kernel_info_gather_ll(std::vector<KernelInfo>& out) {
  append_kernel_info(out, "p2p_gather_ll", p2p_gather_ll_kernel);
}

}  // namespace nsa_cp
