// barrier: one phase of the signal protocol on its own, for transfers the kernels do not make
// themselves (copy-engine pushes and pulls): barrier(phase 0) -> cudaMemcpyAsync -> barrier(phase 1,
// advance=true). Both calls use epoch seq + 1; only the one with advance=true publishes it. A barrier may
// carry a call fingerprint computed by the host (the overlapped boundary's entry): published with the
// signal, compared after the wait, a mismatch recorded as kErrLayoutMismatch.
//
// poison_on_error: one kernel that reads the error record and, only when it is set, overwrites a result
// with NaN bytes (0xFF), so a call whose transfers ran after a failed barrier is never silently wrong.
#include <algorithm>

#include "common.cuh"
#include "launch.h"

namespace nsa_cp {
namespace {

constexpr int kBarrierThreads = 32;  // one thread per peer (world <= 8), one warp

constexpr int kPoisonThreads = 256;
constexpr int kPoisonBlocks = 64;  // only an erred call writes; a clean one reads one word per block

__global__ void __launch_bounds__(kBarrierThreads) barrier_kernel(SignalArgs s, int phase, bool advance,
                                                                  uint32_t fp_on, uint32_t fp_hash, uint32_t fp_desc) {
  const uint32_t epoch = read_epoch(s);
  const CallFingerprint f{fp_hash, fp_desc, epoch};
  // Thread t's fingerprint stores into peer t's pad are ordered before its signal to peer t by the
  // fence inside signal_peer, which also orders everything earlier on this stream (already complete
  // when the kernel starts, copy-engine writes included) before the epoch becomes visible.
  if (fp_on) publish_fingerprint(s, f);
  block_signal_all(s, phase, epoch);
  const bool arrived = block_wait_all(s, phase, epoch);
  if (fp_on && arrived) fingerprints_agree(s, f, phase);
  // seq is written after every thread has read it (block_wait_all synchronizes the block).
  if (advance && threadIdx.x == 0) *reinterpret_cast<volatile uint32_t*>(s.seq) = epoch;
}

__global__ void __launch_bounds__(kPoisonThreads) poison_kernel(const uint32_t* err, uint4* out, int64_t words,
                                                                 uint8_t* tail, int64_t tail_bytes) {
  if (*reinterpret_cast<const volatile uint32_t*>(err) == kErrNone) return;
  const uint4 nan = make_uint4(~0u, ~0u, ~0u, ~0u);
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += step) out[i] = nan;
  if (blockIdx.x == 0 && static_cast<int64_t>(threadIdx.x) < tail_bytes) tail[threadIdx.x] = 0xFF;
}

}  // namespace

void barrier_fingerprinted(uint64_t pads, int rank, int world, int channel, int phase, uint64_t seq, bool advance,
                           uint64_t timeout_ns, uint64_t err, uint64_t stream, bool fp_on, uint32_t fp_hash,
                           uint32_t fp_desc) {
  constexpr const char* fn = "barrier";
  const SignalArgs s = make_signal_args(fn, pads, rank, world, channel, seq, /*arrive=*/0, /*need_arrive=*/false,
                                        timeout_ns, err);
  require(phase == 0 || phase == 1, fn, "phase must be 0 (entered) or 1 (done), got " + std::to_string(phase));
  barrier_kernel<<<1, kBarrierThreads, 0, as_stream(stream)>>>(s, phase, advance, fp_on ? 1u : 0u, fp_hash, fp_desc);
  check_launch(fn);
}

void poison_on_error(uint64_t err, uint64_t ptr, int64_t bytes, uint64_t stream) {
  constexpr const char* fn = "poison_on_error";
  require_ptr(err, fn, "err (device address of the error record)");
  require(bytes >= 0, fn, "bytes must be >= 0, got " + std::to_string(bytes));
  if (bytes == 0) return;
  require_ptr(ptr, fn, "ptr (the result to overwrite when the error record is set)");
  // 16-byte words from the first aligned address; the bytes before it and after the last word byte by byte
  const uint64_t head = std::min<uint64_t>((16 - ptr % 16) % 16, static_cast<uint64_t>(bytes));
  const int64_t words = (bytes - static_cast<int64_t>(head)) / 16;
  const int64_t rest = bytes - static_cast<int64_t>(head) - words * 16;
  const int blocks = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(kPoisonBlocks, (words + kPoisonThreads - 1) / kPoisonThreads)));
  const cudaStream_t st = as_stream(stream);
  poison_kernel<<<blocks, kPoisonThreads, 0, st>>>(as_ptr<const uint32_t>(err), as_ptr<uint4>(ptr + head), words,
                                                    as_ptr<uint8_t>(ptr + head + words * 16), rest);
  check_launch(fn);
  if (head) {
    poison_kernel<<<1, kPoisonThreads, 0, st>>>(as_ptr<const uint32_t>(err), nullptr, 0, as_ptr<uint8_t>(ptr),
                                                static_cast<int64_t>(head));
    check_launch(fn);
  }
}

void barrier(uint64_t pads, int rank, int world, int channel, int phase, uint64_t seq, bool advance,
             uint64_t timeout_ns, uint64_t err, uint64_t stream) {
  barrier_fingerprinted(pads, rank, world, channel, phase, seq, advance, timeout_ns, err, stream, false, 0, 0);
}

void append_kernel_info_barrier(std::vector<KernelInfo>& out) {
  append_kernel_info(out, "barrier", barrier_kernel);
  append_kernel_info(out, "poison_on_error", poison_kernel);
}

}  // namespace nsa_cp
