// P2PState: one rank's P2P transport state, bound once (the idea of DeepEP's Buffer).
//
// The Python transport allocates and maps the buffers (symmetric memory or CUDA IPC), then hands this
// object one P2PConfig (ops.h) naming every address that stays fixed: the peers' gather buffers (both double buffers), reduce
// buffers and signal pads, the local epoch / arrive / gather-state words, the host-mapped error record,
// the timeout and the row geometry. Everything about them is checked here, once. A launch passes only
// what changes per call (source, counts/offsets, max_rank_len, compact, stream, positions), checks only
// that, and first reads the error record: after a device-side error no launch is enqueued
// (P2PDeviceError), since the ranks' signal state no longer agrees.
//
// Launches go to `device` whatever the calling thread's current device (switched and restored around
// the launch), on the stream given, which must belong to that device.
#include <algorithm>

#include "elem.cuh"
#include "launch.h"
#include "p2p_kernels.h"

namespace nsa_cp {
namespace {

constexpr int kChannelGather = 0;
constexpr int kChannelScatter = 1;
constexpr int64_t kBytesPerBlock = 32 << 10;  // data kernels: one block per 32 KB moved, up to every SM
constexpr int kNormBlocksPerSm = 2;           // norm stage: one row per block, two 512-thread blocks per SM

int64_t element_bytes(int dtype) { return dtype == kFP32 ? 4 : 2; }

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

}  // namespace

P2PState::P2PState(const P2PConfig& c)
    : device_(c.device),
      rank_(c.rank),
      world_(c.world),
      dtype_(c.dtype),
      sm_count_(c.sm_count),
      gather_ptrs_(c.gather_ptrs),
      reduce_ptrs_(c.reduce_ptrs),
      pads_(c.pads),
      seq_(c.seq),
      arrive_(c.arrive),
      gather_state_(c.gather_state),
      err_host_(c.err_host),
      err_dev_(c.err_dev),
      timeout_ns_(c.timeout_ns),
      hidden_(c.hidden),
      max_rows_(c.max_rows_per_rank),
      double_rows_(c.double_buffer_rows),
      check_layout_(c.check_layout) {
  constexpr const char* fn = "P2PState";
  require(c.device >= 0, fn, "device must be >= 0, got " + std::to_string(c.device));
  // rank, world, pads, seq, arrive, err: as every signal-protocol launch checks them (both channels)
  make_signal_args(fn, c.pads, c.rank, c.world, kChannelScatter, c.seq, c.arrive, true, c.timeout_ns, c.err_dev);
  require_done_channel(fn, kChannelGather);
  require_ptr(c.gather_ptrs, fn, "gather_ptrs (device uint64[2][world]: every rank's gather buffer 0, then 1)");
  require_ptr(c.reduce_ptrs, fn, "reduce_ptrs (device uint64[world] of reduce buffer bases)");
  require_ptr(c.gather_state, fn, "gather_state (device uint32[2], zero-initialised)");
  require_ptr(c.err_host, fn, "err_host (host address of the host-mapped uint32[ERR_RECORD_WORDS] error record)");
  require(c.dtype == kBF16 || c.dtype == kFP16 || c.dtype == kFP32, fn,
          "dtype must be 0 (bfloat16), 1 (float16) or 2 (float32), got " + std::to_string(c.dtype));
  require(c.hidden > 0 && c.hidden <= (int64_t{1} << 40), fn, "hidden must be in [1, 2^40], got " + std::to_string(c.hidden));
  require(c.sm_count >= 1 && c.sm_count <= kMaxBlocks / kNormBlocksPerSm, fn,
          "sm_count must be in [1, " + std::to_string(kMaxBlocks / kNormBlocksPerSm) + "], got " +
              std::to_string(c.sm_count));
  require(c.max_rows_per_rank >= 1 && c.max_rows_per_rank <= INT32_MAX, fn,
          "max_rows_per_rank must be in [1, 2^31), got " + std::to_string(c.max_rows_per_rank));
  require(c.double_buffer_rows >= 0 && c.double_buffer_rows <= c.max_rows_per_rank, fn,
          "double_buffer_rows must be in [0, max_rows_per_rank=" + std::to_string(c.max_rows_per_rank) + "], got " +
              std::to_string(c.double_buffer_rows));
  row_bytes_ = c.hidden * element_bytes(c.dtype);
  require(c.max_rows_per_rank <= INT64_MAX / (static_cast<int64_t>(c.world) * row_bytes_), fn,
          "buffer size in bytes overflows int64");
}

uint32_t P2PState::fingerprint_flags(bool compact, bool ordered, uint32_t stage) const {
  if (!check_layout_) return 0;
  return kFpOn | (compact ? kFpCompact : 0u) | (ordered ? kFpOrdered : 0u) | stage;
}

SignalArgs P2PState::signals(int channel) const {
  // one uint32 of seq and of arrive per channel
  return SignalArgs{as_ptr<const uint64_t>(pads_), rank_, world_, channel, as_ptr<uint32_t>(seq_) + channel,
                    as_ptr<uint32_t>(arrive_) + channel, timeout_ns_, as_ptr<uint32_t>(err_dev_)};
}

GatherParams P2PState::gather_params(int buffer, uint64_t counts, uint64_t offsets, int64_t max_rank_len, bool compact,
                                     uint64_t positions, int64_t num_positions, uint32_t stage) const {
  return GatherParams{row_bytes_, as_ptr<const uint64_t>(gather_ptrs_) + buffer * world_, as_ptr<const int>(counts),
                      as_ptr<const int>(offsets), max_rank_len, compact, static_cast<uint32_t>(buffer),
                      as_ptr<uint32_t>(gather_state_), as_ptr<const int64_t>(positions),
                      positions != 0 ? num_positions : -1, fingerprint_flags(compact, positions != 0, stage)};
}

ReduceParams P2PState::reduce_params(uint64_t out, int64_t out_row_stride_bytes, uint64_t counts, uint64_t offsets,
                                     int64_t max_rank_len, bool compact, uint64_t positions, int64_t num_positions,
                                     uint32_t stage) const {
  return ReduceParams{as_ptr<char>(out), out_row_stride_bytes, row_bytes_, as_ptr<const uint64_t>(reduce_ptrs_),
                      as_ptr<const int>(counts), as_ptr<const int>(offsets), max_rank_len, compact,
                      as_ptr<const int64_t>(positions), positions != 0 ? num_positions : -1,
                      fingerprint_flags(compact, positions != 0, stage)};
}

void P2PState::check_error_record(const char* fn) const {
  if (closed_) throw std::runtime_error(std::string(fn) + ": the P2P transport was closed");
  const volatile uint32_t* err = as_ptr<volatile uint32_t>(err_host_);
  if (err[0] != kErrNone) {
    throw P2PDeviceError(std::string(fn) + ": the transport's error record holds code " + std::to_string(err[0]) +
                         " (slot " + std::to_string(err[1]) + ", rank " + std::to_string(err[2]) + ", epoch " +
                         std::to_string(err[3]) + "); nothing was enqueued");
  }
}

void P2PState::check_call(const char* fn, uint64_t counts, uint64_t offsets, int64_t max_rank_len, bool compact,
                          uint64_t positions, int64_t num_positions) const {
  require_ptr(counts, fn, "counts (device int32[world])");
  if (compact) require_ptr(offsets, fn, "offsets (device int32[world], needed with compact=True)");
  require(max_rank_len >= 0 && max_rank_len <= max_rows_, fn,
          "max_rank_len must be in [0, max_rows_per_rank=" + std::to_string(max_rows_) + "] (the capacity), got " +
              std::to_string(max_rank_len));
  if (positions != 0) {
    require(compact, fn, "positions (an ordered call) need the compact geometry: pass compact=True");
    require(positions % 8 == 0, fn, "positions must be the address of int64 values (8-byte aligned)");
    require(num_positions >= 0 && num_positions <= world_ * max_rank_len, fn,
            "num_positions must be in [0, world * max_rank_len = " + std::to_string(world_ * max_rank_len) +
                "], got " + std::to_string(num_positions));
  }
}

int P2PState::next_buffer(int64_t max_rank_len) {
  // The second buffer serves every call that fits it, alternating with the first; every rank makes
  // the same calls, so every rank picks the same.
  last_buffer_ = double_rows_ > 0 && max_rank_len <= double_rows_ ? 1 - last_buffer_ : 0;
  return last_buffer_;
}

int P2PState::data_blocks(int64_t max_rank_len) const {
  // One block per 32 KB moved, every SM from 4 MB up: a small call is latency-bound, and a mid-sized one
  // needs more blocks to keep enough 16-byte stores in flight for the link's bandwidth (docs/performance.md).
  const int64_t moved = max_rank_len * row_bytes_ * world_;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(sm_count_, (moved + kBytesPerBlock - 1) / kBytesPerBlock)));
}

int P2PState::row_blocks(int64_t max_rank_len) const {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_rank_len, int64_t{kNormBlocksPerSm} * sm_count_)));
}

int P2PState::norm_words_per_thread(const char* fn) const {
  require(row_bytes_ % 16 == 0, fn,
          "rows must be a multiple of 16 bytes (hidden * element size = " + std::to_string(row_bytes_) + ")");
  const int64_t words_per_thread = (row_bytes_ / 16 + kDataThreads - 1) / kDataThreads;
  require(words_per_thread <= 4, fn,
          "rows of " + std::to_string(row_bytes_) + " bytes are longer than the norm stage holds (" +
              std::to_string(4 * kDataThreads * 16) + ")");
  return static_cast<int>(words_per_thread);
}

void P2PState::check_norm_rows(const char* fn, const char* name, uint64_t ptr, int64_t stride,
                               int64_t max_rank_len) const {
  require(stride >= 0 && stride % 16 == 0 && ptr % 16 == 0, fn,
          std::string(name) + " and its row stride must be 16-byte aligned (got address % 16 = " +
              std::to_string(ptr % 16) + ", stride " + std::to_string(stride) + ")");
  require(stride <= INT64_MAX / (max_rank_len + 1), fn, std::string(name) + " size in bytes overflows int64");
}

void P2PState::check_weight(const char* fn, uint64_t weight, int weight_dtype, double eps) const {
  require_ptr(weight, fn, "weight (device [hidden] vector)");
  require(weight_dtype == kBF16 || weight_dtype == kFP16 || weight_dtype == kFP32, fn,
          "weight_dtype must be 0 (bfloat16), 1 (float16) or 2 (float32), got " + std::to_string(weight_dtype));
  require(weight % element_bytes(weight_dtype) == 0, fn, "weight must be aligned to its element size");
  require(eps >= 0.0, fn, "eps must be >= 0, got " + std::to_string(eps));
}

int64_t P2PState::gather_rows(int buffer) const {
  require(buffer == 0 || buffer == 1, "gather_rows", "buffer must be 0 or 1, got " + std::to_string(buffer));
  return world_ * (buffer == 0 || double_rows_ == 0 ? max_rows_ : double_rows_);
}

int64_t P2PState::scale_offset(int buffer) const { return round_up(gather_rows(buffer) * hidden_, 16); }

int P2PState::gather(uint64_t src, int64_t src_row_stride_bytes, uint64_t counts, uint64_t offsets,
                     int64_t max_rank_len, bool compact, uint64_t stream, uint64_t positions, int64_t num_positions) {
  constexpr const char* fn = "P2PState.gather";
  check_error_record(fn);
  check_call(fn, counts, offsets, max_rank_len, compact, positions, num_positions);  // first: bounds max_rank_len
  require(src_row_stride_bytes >= 0, fn,
          "src_row_stride_bytes must be >= 0, got " + std::to_string(src_row_stride_bytes));
  require(src_row_stride_bytes <= INT64_MAX / (max_rank_len + 1), fn, "source size in bytes overflows int64");
  const DeviceGuard guard(device_, fn);
  const int buffer = next_buffer(max_rank_len);
  const SignalArgs s = signals(kChannelGather);
  const GatherParams p = gather_params(buffer, counts, offsets, max_rank_len, compact, positions, num_positions,
                                       0);
  const int vec = common_alignment({src, static_cast<uint64_t>(src_row_stride_bytes), static_cast<uint64_t>(row_bytes_)});
  enqueue_gather_copy(p, CopySource{as_ptr<const char>(src), src_row_stride_bytes}, s, vec,
                      data_blocks(max_rank_len), as_stream(stream));
  check_launch(fn);
  return buffer;
}

int P2PState::norm_gather(uint64_t x, int64_t x_row_stride_bytes, uint64_t residual, int64_t residual_row_stride_bytes,
                          uint64_t weight, int weight_dtype, double eps, bool norm, int quant, uint64_t counts,
                          uint64_t offsets, int64_t max_rank_len, bool compact, uint64_t stream, uint64_t positions,
                          int64_t num_positions) {
  constexpr const char* fn = "P2PState.norm_gather";
  check_error_record(fn);
  check_call(fn, counts, offsets, max_rank_len, compact, positions, num_positions);  // first: bounds max_rank_len
  require(quant_group(quant) > 0, fn,
          "quant must be a wire format's code (QUANT_*: 0 none, 1 fp8_e4m3_g128, ...), got " + std::to_string(quant));
  require(norm || quant != 0, fn, "norm=False needs a quant code: without either there is nothing to compute (use gather)");
  const int words_per_thread = norm_words_per_thread(fn);
  check_norm_rows(fn, "x", x, x_row_stride_bytes, max_rank_len);
  if (residual != 0) {
    require(norm, fn, "a residual needs norm=True");
    check_norm_rows(fn, "residual", residual, residual_row_stride_bytes, max_rank_len);
  }
  if (norm) check_weight(fn, weight, weight_dtype, eps);
  if (quant != 0) {
    require(hidden_ % quant_group(quant) == 0, fn,
            "quant " + std::to_string(quant) + " needs hidden to be a multiple of " +
                std::to_string(quant_group(quant)) + ", got " + std::to_string(hidden_));
  }
  const DeviceGuard guard(device_, fn);
  const int buffer = next_buffer(max_rank_len);
  const SignalArgs s = signals(kChannelGather);
  const GatherParams p = gather_params(buffer, counts, offsets, max_rank_len, compact, positions, num_positions,
                                       (norm ? kFpNorm : 0u) | fp_format(quant));
  const NormSource a{as_ptr<const char>(x),  x_row_stride_bytes, as_ptr<char>(residual), residual_row_stride_bytes,
                     as_ptr<const void>(weight), weight_dtype, static_cast<float>(eps), norm, hidden_,
                     scale_offset(buffer)};
  enqueue_gather_norm(p, a, s, dtype_, words_per_thread, quant, row_blocks(max_rank_len),
                      as_stream(stream));
  check_launch(fn);
  return buffer;
}

void P2PState::reduce_scatter(uint64_t out, int64_t out_row_stride_bytes, uint64_t counts, uint64_t offsets,
                              int64_t max_rank_len, bool compact, uint64_t stream, uint64_t positions,
                              int64_t num_positions) {
  constexpr const char* fn = "P2PState.reduce_scatter";
  check_error_record(fn);
  check_call(fn, counts, offsets, max_rank_len, compact, positions, num_positions);  // first: bounds max_rank_len
  const int64_t elem = element_bytes(dtype_);
  require(out_row_stride_bytes >= row_bytes_ && out_row_stride_bytes % elem == 0, fn,
          "out_row_stride_bytes must be >= hidden * element size (" + std::to_string(row_bytes_) +
              ") and a multiple of the element size, got " + std::to_string(out_row_stride_bytes));
  require(out % elem == 0, fn, "out must be aligned to the element size (" + std::to_string(elem) + ")");
  require(out_row_stride_bytes <= INT64_MAX / (max_rank_len + 1), fn, "output size in bytes overflows int64");
  const DeviceGuard guard(device_, fn);
  const SignalArgs s = signals(kChannelScatter);
  const ReduceParams p = reduce_params(out, out_row_stride_bytes, counts, offsets, max_rank_len, compact, positions,
                                       num_positions, kFpScatter);
  const bool vector =
      common_alignment({out, static_cast<uint64_t>(out_row_stride_bytes), static_cast<uint64_t>(row_bytes_)}) == 16;
  enqueue_reduce_scatter(p, s, dtype_, vector, data_blocks(max_rank_len), as_stream(stream));
  check_launch(fn);
}

void P2PState::reduce_scatter_norm(uint64_t out, int64_t out_row_stride_bytes, uint64_t residual,
                                   int64_t residual_row_stride_bytes, uint64_t weight, int weight_dtype, double eps,
                                   uint64_t counts, uint64_t offsets, int64_t max_rank_len, bool compact,
                                   uint64_t stream, uint64_t positions, int64_t num_positions) {
  constexpr const char* fn = "P2PState.reduce_scatter_norm";
  check_error_record(fn);
  check_call(fn, counts, offsets, max_rank_len, compact, positions, num_positions);  // first: bounds max_rank_len
  const int words_per_thread = norm_words_per_thread(fn);
  check_norm_rows(fn, "out", out, out_row_stride_bytes, max_rank_len);
  require(out_row_stride_bytes >= row_bytes_, fn,
          "out_row_stride_bytes must be >= hidden * element size (" + std::to_string(row_bytes_) + "), got " +
              std::to_string(out_row_stride_bytes));
  // residual may be 0 (an empty tensor) only when this rank has no rows: the kernel checks that.
  check_norm_rows(fn, "residual", residual, residual_row_stride_bytes, max_rank_len);
  check_weight(fn, weight, weight_dtype, eps);
  const DeviceGuard guard(device_, fn);
  const SignalArgs s = signals(kChannelScatter);
  const ReduceParams p = reduce_params(out, out_row_stride_bytes, counts, offsets, max_rank_len, compact, positions,
                                       num_positions, kFpScatter | kFpNorm);
  const NormEpilogue e{as_ptr<char>(residual), residual_row_stride_bytes, as_ptr<const void>(weight), weight_dtype,
                       static_cast<float>(eps), hidden_};
  enqueue_reduce_scatter_norm(p, e, s, dtype_, words_per_thread, row_blocks(max_rank_len), as_stream(stream));
  check_launch(fn);
}

void P2PState::barrier(uint64_t stream) {
  constexpr const char* fn = "P2PState.barrier";
  check_error_record(fn);
  const DeviceGuard guard(device_, fn);
  nsa_cp::barrier(pads_, rank_, world_, kChannelGather, 1, seq_, true, timeout_ns_, err_dev_, stream);
}

void P2PState::copy_engine_begin(uint64_t stream) {
  constexpr const char* fn = "P2PState.copy_engine_begin";
  check_error_record(fn);
  const DeviceGuard guard(device_, fn);
  nsa_cp::barrier(pads_, rank_, world_, kChannelGather, 0, seq_, false, timeout_ns_, err_dev_, stream);
}

void P2PState::copy_engine_end(uint64_t stream) {
  constexpr const char* fn = "P2PState.copy_engine_end";
  if (closed_) throw std::runtime_error(std::string(fn) + ": the P2P transport was closed");
  const DeviceGuard guard(device_, fn);
  nsa_cp::barrier(pads_, rank_, world_, kChannelGather, 1, seq_, true, timeout_ns_, err_dev_, stream);
  // The tag of the buffer written, which the next kernel gather compares with: 0.
  check_cuda(cudaMemsetAsync(as_ptr<void>(gather_state_), 0, sizeof(uint32_t), as_stream(stream)), fn,
             "cudaMemsetAsync");
  last_buffer_ = 0;
}

void P2PState::pull_begin(uint64_t stream, uint32_t fp_hash, uint32_t fp_desc) {
  constexpr const char* fn = "P2PState.pull_begin";
  check_error_record(fn);
  const DeviceGuard guard(device_, fn);
  nsa_cp::barrier_fingerprinted(pads_, rank_, world_, kChannelGather, 0, seq_, false, timeout_ns_, err_dev_, stream,
                                check_layout_, fp_hash, fp_desc);
}

void P2PState::poison_on_error(uint64_t ptr, int64_t bytes, uint64_t stream) {
  constexpr const char* fn = "P2PState.poison_on_error";
  if (closed_) throw std::runtime_error(std::string(fn) + ": the P2P transport was closed");
  const DeviceGuard guard(device_, fn);
  nsa_cp::poison_on_error(err_dev_, ptr, bytes, stream);
}

std::vector<uint32_t> P2PState::error() const {
  if (closed_) throw std::runtime_error("P2PState.error: the P2P transport was closed");
  const volatile uint32_t* err = as_ptr<volatile uint32_t>(err_host_);
  std::vector<uint32_t> record(kErrRecordWords);
  for (int i = 0; i < kErrRecordWords; ++i) record[i] = err[i];
  return record;
}

}  // namespace nsa_cp
