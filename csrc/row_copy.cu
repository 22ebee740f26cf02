// row_copy: the layout conversions of the NCCL path (nsa_cp/rows/kernels), natively. Each is one launch
// whose row counts come from device memory (CUDA-graph replays may change them; the host never syncs).
//
// They exist because of host time, not device time: the same copies as the Triton kernels of
// nsa_cp/rows/kernels, but one launch through pybind11 costs far less CPU time than Triton's launcher
// (benchmarks/host_overhead.py; figures in docs/performance.md), and the NCCL path runs one or two
// of them per collective. Without nsa_cp._C the Triton kernels do the same work.
//
//   pack_rows:      dst[r] = src[r] for r < n, dst[r] = 0 for n <= r < dst_rows, n = clamp(*count, 0,
//                   min(src_rows, dst_rows)): one rank's shard into its slot of the padded buffer.
//   padded_compact: for every rank q and r < counts[q] (clamped to [0, M]):
//                   compact[offsets[q] + r] = padded[q*M + r] (to_compact), or the reverse, which also
//                   writes zeros to padded[q*M + r] for counts[q] <= r < M. Rows whose compact index
//                   falls outside [0, compact_rows) are skipped (bad offsets cannot write out of bounds).
#include "geometry.cuh"
#include "launch.h"

namespace nsa_cp {
namespace {

constexpr int kCopyThreads = 256;
constexpr int kCopyUnroll = 4;        // independent loads in flight per thread
constexpr int64_t kMaxCopyBlocks = 4096;  // grid-stride beyond this (tens of blocks per SM on any current GPU)

__device__ __forceinline__ int64_t clamp_count(int c, int64_t hi) {
  return c < 0 ? 0 : (c > hi ? hi : static_cast<int64_t>(c));
}

// Copies rows [0, n) of a [rows, chunks] grid of VEC-byte words from src to dst and zeroes rows
// [n, rows) of dst (zero_tail), walking it with this block's share of `threads` threads from `start`.
template <int VEC>
__device__ __forceinline__ void copy_rows(const char* src, int64_t src_stride, char* dst, int64_t dst_stride,
                                          int64_t chunks, int64_t n, int64_t rows, bool zero_tail, int64_t start,
                                          int64_t threads) {
  using W = typename Word<VEC>::type;
  const int64_t last = zero_tail ? rows : n;
  RowChunkCursor c(start, threads, chunks);
  while (c.row < last) {
    W v[kCopyUnroll];
    int64_t row[kCopyUnroll], chunk[kCopyUnroll];
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      row[u] = c.row;
      chunk[u] = c.chunk;
      v[u] = W{};
      if (c.row < n) v[u] = *reinterpret_cast<const W*>(src + c.row * src_stride + c.chunk * VEC);
      c.advance();
    }
#pragma unroll
    for (int u = 0; u < kCopyUnroll; ++u) {
      if (row[u] < last) *reinterpret_cast<W*>(dst + row[u] * dst_stride + chunk[u] * VEC) = v[u];
    }
  }
}

struct PackParams {
  const char* src;
  int64_t src_stride;  // bytes
  int64_t src_rows;
  char* dst;
  int64_t dst_stride;  // bytes
  int64_t dst_rows;
  int64_t row_bytes;
  const int* count;
};

template <int VEC>
__global__ void __launch_bounds__(kCopyThreads) pack_rows_kernel(const PackParams p) {
  const int64_t n = clamp_count(*p.count, p.src_rows < p.dst_rows ? p.src_rows : p.dst_rows);
  copy_rows<VEC>(p.src, p.src_stride, p.dst, p.dst_stride, p.row_bytes / VEC, n, p.dst_rows, true, global_thread(),
                 grid_threads());
}

struct PaddedCompactParams {
  char* padded;
  int64_t padded_stride;  // bytes
  char* compact;
  int64_t compact_stride;  // bytes
  int64_t compact_rows;
  int64_t row_bytes;
  const int* counts;
  const int* offsets;
  int64_t M;
  bool to_compact;
};

// Grid (blocks per rank, world): blockIdx.y is the rank whose slot this block converts.
template <int VEC>
__global__ void __launch_bounds__(kCopyThreads) padded_compact_kernel(const PaddedCompactParams p) {
  const int q = blockIdx.y;
  const int64_t n = clamp_count(p.counts[q], p.M);
  const int64_t first = p.offsets[q];
  // rows of this rank that land inside the compact tensor: [lo, hi) of [0, n)
  const int64_t lo = first < 0 ? -first : 0;
  const int64_t room = p.compact_rows - first;
  const int64_t hi = room < n ? (room > 0 ? room : 0) : n;
  char* slot = p.padded + q * p.M * p.padded_stride;
  const int64_t start = global_thread(), threads = grid_threads();  // along x: this rank's blocks
  const int64_t chunks = p.row_bytes / VEC;
  if (p.to_compact) {
    if (hi > lo) {
      copy_rows<VEC>(slot + lo * p.padded_stride, p.padded_stride, p.compact + (first + lo) * p.compact_stride,
                     p.compact_stride, chunks, hi - lo, hi - lo, false, start, threads);
    }
    return;
  }
  // Expand: real rows inside the compact tensor are copied, every other row of the slot is zeroed.
  if (lo > 0) {
    copy_rows<VEC>(nullptr, 0, slot, p.padded_stride, chunks, 0, lo < n ? lo : n, true, start, threads);
  }
  if (hi > lo) {
    copy_rows<VEC>(p.compact + (first + lo) * p.compact_stride, p.compact_stride, slot + lo * p.padded_stride,
                   p.padded_stride, chunks, hi - lo, hi - lo, false, start, threads);
  }
  const int64_t tail = hi > lo ? hi : (lo < n ? lo : n);
  copy_rows<VEC>(nullptr, 0, slot + tail * p.padded_stride, p.padded_stride, chunks, 0, p.M - tail, true, start,
                 threads);
}

// Blocks for `rows` rows of `chunks` words: every thread moves about kCopyUnroll words.
int copy_blocks(int64_t rows, int64_t chunks) {
  const int64_t per_block = static_cast<int64_t>(kCopyThreads) * kCopyUnroll;
  const int64_t blocks = (rows * chunks + per_block - 1) / per_block;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxCopyBlocks ? kMaxCopyBlocks : blocks));
}

void require_rows(const char* fn, const char* name, uint64_t ptr, int64_t stride, int64_t rows, int64_t row_bytes) {
  require(rows >= 0 && rows <= INT32_MAX, fn, std::string(name) + " rows must be in [0, 2^31), got " + std::to_string(rows));
  require(stride >= row_bytes, fn,
          std::string(name) + " row stride (" + std::to_string(stride) + " bytes) must be >= row_bytes (" +
              std::to_string(row_bytes) + ")");
  require(rows == 0 || stride <= INT64_MAX / rows, fn, std::string(name) + " size in bytes overflows int64");
  if (rows > 0) require_ptr(ptr, fn, name);
}

}  // namespace

void pack_rows(uint64_t src, int64_t src_row_stride_bytes, int64_t src_rows, uint64_t dst,
               int64_t dst_row_stride_bytes, int64_t dst_rows, int64_t row_bytes, uint64_t count, uint64_t stream) {
  constexpr const char* fn = "pack_rows";
  require(row_bytes > 0, fn, "row_bytes must be > 0, got " + std::to_string(row_bytes));
  require_rows(fn, "dst", dst, dst_row_stride_bytes, dst_rows, row_bytes);
  require_rows(fn, "src", src, src_row_stride_bytes, src_rows, row_bytes);
  require_ptr(count, fn, "count (device int32)");
  if (dst_rows == 0) return;
  const PackParams p{as_ptr<const char>(src), src_row_stride_bytes, src_rows, as_ptr<char>(dst),
                     dst_row_stride_bytes,     dst_rows,            row_bytes, as_ptr<const int>(count)};
  const int vec = common_alignment({src, dst, static_cast<uint64_t>(src_row_stride_bytes),
                                    static_cast<uint64_t>(dst_row_stride_bytes), static_cast<uint64_t>(row_bytes)});
  const int blocks = copy_blocks(dst_rows, row_bytes / vec);
  with_word_width(vec, [&](auto width) {
    pack_rows_kernel<decltype(width)::value><<<blocks, kCopyThreads, 0, as_stream(stream)>>>(p);
  });
  check_launch(fn);
}

void padded_compact(uint64_t padded, int64_t padded_row_stride_bytes, uint64_t compact,
                    int64_t compact_row_stride_bytes, int64_t compact_rows, int64_t row_bytes, uint64_t counts,
                    uint64_t offsets, int64_t max_rank_len, int world, bool to_compact, uint64_t stream) {
  constexpr const char* fn = "padded_compact";
  require(row_bytes > 0, fn, "row_bytes must be > 0, got " + std::to_string(row_bytes));
  require(world >= 1 && world <= 65535, fn, "world must be in [1, 65535], got " + std::to_string(world));
  require(max_rank_len >= 0 && max_rank_len <= INT32_MAX / world, fn,
          "world * max_rank_len must be < 2^31, got " + std::to_string(world) + " * " + std::to_string(max_rank_len));
  require_rows(fn, "padded", padded, padded_row_stride_bytes, world * max_rank_len, row_bytes);
  require_rows(fn, "compact", compact, compact_row_stride_bytes, compact_rows, row_bytes);
  require_ptr(counts, fn, "counts (device int32[world])");
  require_ptr(offsets, fn, "offsets (device int32[world])");
  if (max_rank_len == 0) return;
  const PaddedCompactParams p{as_ptr<char>(padded), padded_row_stride_bytes, as_ptr<char>(compact),
                              compact_row_stride_bytes, compact_rows, row_bytes,
                              as_ptr<const int>(counts), as_ptr<const int>(offsets), max_rank_len,
                              to_compact};
  const int vec = common_alignment({padded, compact, static_cast<uint64_t>(padded_row_stride_bytes),
                                    static_cast<uint64_t>(compact_row_stride_bytes), static_cast<uint64_t>(row_bytes)});
  const dim3 grid(copy_blocks(max_rank_len, row_bytes / vec), world);
  with_word_width(vec, [&](auto width) {
    padded_compact_kernel<decltype(width)::value><<<grid, kCopyThreads, 0, as_stream(stream)>>>(p);
  });
  check_launch(fn);
}

void append_kernel_info_row_copy(std::vector<KernelInfo>& out) {
  append_kernel_info(out, "pack_rows<16>", pack_rows_kernel<16>);
  append_kernel_info(out, "pack_rows<4>", pack_rows_kernel<4>);
  append_kernel_info(out, "pack_rows<1>", pack_rows_kernel<1>);
  append_kernel_info(out, "padded_compact<16>", padded_compact_kernel<16>);
  append_kernel_info(out, "padded_compact<4>", padded_compact_kernel<4>);
  append_kernel_info(out, "padded_compact<1>", padded_compact_kernel<1>);
}

}  // namespace nsa_cp
