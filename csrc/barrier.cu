// barrier: one phase of the signal protocol on its own, for transfers the kernels do not make
// themselves (copy-engine pushes): barrier(phase 0) -> cudaMemcpyAsync to peers -> barrier(phase 1,
// advance=true). Both calls use epoch seq + 1; only the one with advance=true publishes it.
#include "common.cuh"
#include "launch.h"

namespace nsa_cp {
namespace {

constexpr int kBarrierThreads = 32;  // one thread per peer (world <= 8), one warp

__global__ void __launch_bounds__(kBarrierThreads) barrier_kernel(SignalArgs s, int phase, bool advance) {
  const uint32_t epoch = read_epoch(s);
  // The fence inside signal_peer orders everything earlier on this stream (already complete when the
  // kernel starts, copy-engine writes included) before the epoch becomes visible.
  block_signal_all(s, phase, epoch);
  block_wait_all(s, phase, epoch);
  // seq is written after every thread has read it (block_wait_all synchronizes the block).
  if (advance && threadIdx.x == 0) *reinterpret_cast<volatile uint32_t*>(s.seq) = epoch;
}

}  // namespace

void barrier(uint64_t pads, int rank, int world, int channel, int phase, uint64_t seq, bool advance,
             uint64_t timeout_ns, uint64_t err, uint64_t stream) {
  constexpr const char* fn = "barrier";
  const SignalArgs s = make_signal_args(fn, pads, rank, world, channel, seq, /*arrive=*/0, /*need_arrive=*/false,
                                        timeout_ns, err);
  require(phase == 0 || phase == 1, fn, "phase must be 0 (entered) or 1 (done), got " + std::to_string(phase));
  barrier_kernel<<<1, kBarrierThreads, 0, as_stream(stream)>>>(s, phase, advance);
  check_launch(fn);
}

void append_kernel_info_barrier(std::vector<KernelInfo>& out) { append_kernel_info(out, "barrier", barrier_kernel); }

}  // namespace nsa_cp
