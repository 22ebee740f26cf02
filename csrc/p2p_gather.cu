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
// The source stages (CopyStage, NormStage<D, K, Fmt>) and the FP8 byte layout: p2p_gather_stages.cuh.

#include <cctype>
#include <string>

#include "geometry.cuh"
#include "launch.h"
#include "p2p_gather_stages.cuh"
#include "p2p_kernels.h"

namespace nsa_cp {
namespace {

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

template <int D, class Fmt>
void launch_norm(const GatherParams& p, const NormSource& a, const SignalArgs& s, int words_per_thread,
                 int num_blocks, cudaStream_t st) {
  if (words_per_thread <= 2) {
    p2p_gather_kernel<NormStage<D, 2, Fmt>><<<num_blocks, kDataThreads, 0, st>>>(p, a, s);
  } else {
    p2p_gather_kernel<NormStage<D, 4, Fmt>><<<num_blocks, kDataThreads, 0, st>>>(p, a, s);
  }
}

template <class Fmt>
void launch_norm_typed(const GatherParams& p, const NormSource& a, const SignalArgs& s, int dtype,
                       int words_per_thread, int num_blocks, cudaStream_t st) {
  switch (dtype) {
    case kBF16:
      launch_norm<kBF16, Fmt>(p, a, s, words_per_thread, num_blocks, st);
      break;
    case kFP16:
      launch_norm<kFP16, Fmt>(p, a, s, words_per_thread, num_blocks, st);
      break;
    default:
      launch_norm<kFP32, Fmt>(p, a, s, words_per_thread, num_blocks, st);
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
                         int words_per_thread, int quant, int num_blocks, cudaStream_t stream) {
  with_format(quant, [&](auto fmt) {
    launch_norm_typed<decltype(fmt)>(p, src, s, dtype, words_per_thread, num_blocks, stream);
  });
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
// The norm stage of one dtype in every wire format, 2 and 4 words per thread: "p2p_gather<norm,bf16,2>",
// "p2p_gather<fp8_e4m3_g128,bf16,4>" (the format's name in nsa_cp/geometry/wire.py) and so on.
template <int D, class... F>
void append_norm_kernel_info(std::vector<KernelInfo>& out, const std::string& dtype, FormatList<F...>) {
  const auto one = [&](auto fmt) {
    using Fmt = decltype(fmt);
    std::string name = Fmt::kCode == 0 ? "norm" : std::string(Fmt::kName).substr(6);  // QUANT_FP8_.. -> fp8_..
    for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    name = "p2p_gather<" + name + "," + dtype;
    append_kernel_info(out, (name + ",2>").c_str(), p2p_gather_kernel<NormStage<D, 2, Fmt>>);
    append_kernel_info(out, (name + ",4>").c_str(), p2p_gather_kernel<NormStage<D, 4, Fmt>>);
  };
  (one(F{}), ...);
}
}  // namespace

void append_kernel_info_gather(std::vector<KernelInfo>& out) {
  append_kernel_info(out, "p2p_gather<copy16>", p2p_gather_kernel<CopyStage<16>>);
  append_kernel_info(out, "p2p_gather<copy4>", p2p_gather_kernel<CopyStage<4>>);
  append_kernel_info(out, "p2p_gather<copy1>", p2p_gather_kernel<CopyStage<1>>);
  append_norm_kernel_info<kBF16>(out, "bf16", WireFormats{});
  append_norm_kernel_info<kFP16>(out, "fp16", WireFormats{});
  append_norm_kernel_info<kFP32>(out, "fp32", WireFormats{});
}

}  // namespace nsa_cp
