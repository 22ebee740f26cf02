// Shared device helpers of nsa_cp._C: the cross-GPU signal protocol and the error record.
//
// Protocol (every kernel family uses it the same way):
//   * Each rank owns a symmetric "signal pad" (uint32) that peers write through mapped pointers.
//     A call on channel c uses, in every rank's pad, the slots pad[(c*2 + phase)*world + src]:
//     phase 0 = "entered", phase 1 = "done"; src is the rank that wrote the slot.
//   * Epochs: a per-channel uint32 `seq` in ordinary local device memory holds the last finished
//     epoch. Every block reads epoch = seq + 1 at its start; the last block to finish (counted on a
//     local `arrive` counter, which it resets) stores seq = epoch at the very end, so every block of
//     one launch sees the same epoch and the next launch sees the next one.
//   * Signal: __threadfence_system() (all earlier writes of this thread, local or remote, become
//     visible system-wide), then a system-scope release store of the epoch into the peer's slot.
//   * Wait: acquire loads of our own slot until (int32_t)(value - epoch) >= 0 (wrap-safe; a slot may
//     already hold a later epoch of a peer that ran ahead). Optional timeout on %globaltimer; on
//     timeout the first error is recorded into a host-mapped uint32[4] and the wait gives up.
//   * Done counters (the gather's done phase; see grid_done_counters): pad[kDoneBase + c*kMaxWorld +
//     src] only grows, by kDoneQuantum per launch of src, in shares added by each of src's blocks
//     with a system-scope release reduction once that block's stores are ordered. The receiver keeps
//     the total it has consumed (local memory) and waits for it + kDoneQuantum, so it needs no block of
//     the sender to collect the others first, and the sender's grid size does not matter.
//
//   * Call fingerprints (P2PState launches; see CallFingerprint below): block 0 of every launch writes
//     what its call assumes (a hash of the layout counts, max_rank_len, positions count, row bytes and
//     flags; the flags and total rows; the epoch) into slot [channel][epoch & 1][our rank] of every
//     peer's pad, with plain stores by the threads that then signal that peer (entry) or add to its
//     done counter, so the release that follows carries it. A receiver compares every peer's slot with
//     its own fingerprint once the signal it already waits for has come: the reduce-scatter after its
//     entry wait (before it reads a row), the gather after its entry wait when it has one, otherwise in
//     its last block after the done wait (the rows have landed; on a mismatch it overwrites its own
//     result with NaN bytes). No extra signal, no extra wait. Two slots by epoch parity: a peer can be
//     one call ahead of us on a channel, never two, before we have read its slot.
//
// Error record err[kErrRecordWords] (host-mapped, read it after the stream has synchronized):
//   err[0] = code (0 none, kErrTimeout, kErrBadDeviceArg, kErrBadPosition, kErrLayoutMismatch),
//   err[1] = channel*2 + phase, err[2] = peer rank waited for (timeout), the rank whose device-side
//   argument was bad, the rank that read an out-of-range position, or the peer whose fingerprint
//   differs; err[3] = epoch; a mismatch also: err[4..5] our fingerprint's hash and desc, err[6..7] the
//   peer's, err[8] the peer's epoch. Only the first error is kept (atomicCAS on err[0]).
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_runtime.h>

#include "ops.h"  // kMaxWorld, error codes

namespace nsa_cp {

// Arrivals are counted in the low 16 bits of `arrive`; a block that failed adds kArriveFailed too,
// so the last block learns, from the same atomic, whether any block of the launch failed.
constexpr uint32_t kArriveCountMask = 0xFFFFu;
constexpr uint32_t kArriveFailed = 0x10000u;

// Everything a kernel needs to take part in the signal protocol (passed by value).
struct SignalArgs {
  const uint64_t* pads;  // device uint64[world]: every rank's pad base, mapped into our address space
  int rank;
  int world;
  int channel;
  uint32_t* seq;         // local device uint32: last finished epoch of this channel
  uint32_t* arrive;      // local device uint32: blocks that have finished this launch (reset to 0)
  uint64_t timeout_ns;   // 0 = wait forever
  uint32_t* err;         // host-mapped uint32[4] (device address)
};

__device__ __forceinline__ uint32_t ld_acquire_sys(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint32_t* p, uint32_t v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ void red_release_sys_add(uint32_t* p, uint32_t v) {
  asm volatile("red.release.sys.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Bypasses L1: `seq` was written by an earlier launch.
__device__ __forceinline__ uint32_t ld_relaxed_gpu(const uint32_t* p) {
  uint32_t v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ uint64_t globaltimer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ uint32_t read_epoch(const SignalArgs& s) { return ld_relaxed_gpu(s.seq) + 1u; }

__device__ __forceinline__ uint32_t* pad_slot(uint64_t pad_base, int world, int channel, int phase, int src) {
  return reinterpret_cast<uint32_t*>(pad_base) + ((channel * 2 + phase) * world + src);
}

// Keeps the first error only. err lives in host-mapped memory: the fields after err[0] are complete
// once the kernel has finished, which is when the host reads them.
__device__ __forceinline__ void record_error(uint32_t* err, uint32_t code, uint32_t slot, uint32_t rank,
                                             uint32_t epoch) {
  if (atomicCAS(err, kErrNone, code) == kErrNone) {
    volatile uint32_t* e = err;
    e[1] = slot;
    e[2] = rank;
    e[3] = epoch;
    __threadfence_system();
  }
}

// ---- call fingerprints --------------------------------------------------------------------------

// Flags of a call's fingerprint (desc bits 0..7): bits 0..4 below (kFpOverlap: the overlapped boundary's
// entry barrier, whose fingerprint the host computes), bits 5..7 the wire format's code
// (codes.h, kCode < 8), so ranks that disagree on the format disagree on the fingerprint. Bit 31 of
// GatherParams/ReduceParams::fp_flags turns the check on.
constexpr uint32_t kFpCompact = 1u, kFpOrdered = 2u, kFpNorm = 4u, kFpOverlap = 8u, kFpScatter = 16u;
constexpr int kFpFormatShift = 5;
constexpr uint32_t kFpOn = 1u << 31;
__host__ __device__ constexpr uint32_t fp_format(int code) {
  return (static_cast<uint32_t>(code) & 7u) << kFpFormatShift;
}

struct CallFingerprint {
  uint32_t hash;  // counts of every rank, max_rank_len, positions count, row bytes, flags
  uint32_t desc;  // flags | min(total rows, 2^24 - 1) << 8
  uint32_t epoch;
};

__device__ __forceinline__ uint32_t fp_mix(uint32_t h, uint32_t v) {
  h ^= v;
  h *= 0x9E3779B1u;
  return h ^ (h >> 15);
}

// Every thread of warp 0 gets the fingerprint (the other warps compute a value nobody uses). Rank t's
// count is in lane t's registers already (load_geometry_entry), so it costs three shuffles, not a
// pass over shared memory: the entry signal waits for nothing more than the count's load.
__device__ __forceinline__ CallFingerprint call_fingerprint(int count, int world, int64_t M,
                                                            int64_t num_positions, int64_t row_bytes, uint32_t flags,
                                                            uint32_t epoch) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  uint32_t h = lane < world ? fp_mix(fp_mix(0x811C9DC5u, static_cast<uint32_t>(lane)), static_cast<uint32_t>(count)) : 0u;
  uint32_t total = lane < world ? static_cast<uint32_t>(count) : 0u;
#pragma unroll
  for (int o = kMaxWorld / 2; o > 0; o >>= 1) {  // lanes 0..7 end with the sums over lanes 0..7
    h += __shfl_xor_sync(0xffffffffu, h, o);
    total += __shfl_xor_sync(0xffffffffu, total, o);
  }
  h = fp_mix(h, static_cast<uint32_t>(M));
  h = fp_mix(h, static_cast<uint32_t>(num_positions));
  h = fp_mix(h, static_cast<uint32_t>(row_bytes));
  h = fp_mix(h, flags & 0xFFu);
  return CallFingerprint{h, (flags & 0xFFu) | (min(total, 0xFFFFFFu) << 8), epoch};
}

__device__ __forceinline__ uint32_t* fp_slot(uint64_t pad_base, int channel, uint32_t epoch, int src) {
  return reinterpret_cast<uint32_t*>(pad_base) + kFpBase +
         ((channel * 2 + static_cast<int>(epoch & 1u)) * kMaxWorld + src) * kFpWords;
}

// Block 0, threads t < world: our fingerprint into peer t's pad (plain stores; thread t's next signal
// or done-counter release to peer t orders them).
__device__ __forceinline__ void publish_fingerprint(const SignalArgs& s, const CallFingerprint& f) {
  const int t = static_cast<int>(threadIdx.x);
  if (t < s.world) {
    volatile uint32_t* slot = fp_slot(s.pads[t], s.channel, f.epoch, s.rank);
    slot[0] = f.hash;
    slot[1] = f.desc;
    slot[2] = f.epoch;
  }
}

// Threads t < world compare peer t's fingerprint in our pad with ours (after the acquire of a signal
// or counter of that peer for this call); a mismatch is recorded (phase `phase`). Contains
// __syncthreads: call from all threads of the block. True when every rank agrees.
__device__ __forceinline__ bool fingerprints_agree(const SignalArgs& s, const CallFingerprint& f, int phase) {
  const int t = static_cast<int>(threadIdx.x);
  int ok = 1;
  if (t < s.world) {
    const volatile uint32_t* slot = fp_slot(s.pads[s.rank], s.channel, f.epoch, t);
    const uint32_t h = slot[0], d = slot[1], e = slot[2];
    if (h != f.hash || d != f.desc || e != f.epoch) {
      ok = 0;
      if (atomicCAS(s.err, kErrNone, kErrLayoutMismatch) == kErrNone) {
        volatile uint32_t* r = s.err;
        r[1] = static_cast<uint32_t>(s.channel * 2 + phase);
        r[2] = static_cast<uint32_t>(t);
        r[3] = f.epoch;
        r[4] = f.hash;
        r[5] = f.desc;
        r[6] = h;
        r[7] = d;
        r[8] = e;
        __threadfence_system();
      }
    }
  }
  return __syncthreads_and(ok) != 0;
}

// Writes `epoch` into slot [phase][our rank] of `peer`'s pad. The fence makes every earlier write of
// this thread (and, through the caller's __syncthreads / arrive chain, of the threads it synchronized
// with) visible system-wide before the peer can observe the epoch.
__device__ __forceinline__ void signal_peer(const SignalArgs& s, int peer, int phase, uint32_t epoch) {
  __threadfence_system();
  st_release_sys(pad_slot(s.pads[peer], s.world, s.channel, phase, s.rank), epoch);
}

// Waits until `slot` (in our own pad, written by `peer`) holds a value >= `target` (wrap-safe).
// Returns false (after recording a timeout of `phase` of this call, epoch `epoch`) on timeout.
__device__ __forceinline__ bool wait_at_least(const SignalArgs& s, const uint32_t* slot, uint32_t target, int peer,
                                              int phase, uint32_t epoch) {
  if (static_cast<int32_t>(ld_acquire_sys(slot) - target) >= 0) return true;
  const uint64_t start = s.timeout_ns ? globaltimer_ns() : 0;
  while (true) {
    if (static_cast<int32_t>(ld_acquire_sys(slot) - target) >= 0) return true;
    if (s.timeout_ns && globaltimer_ns() - start > s.timeout_ns) {
      record_error(s.err, kErrTimeout, static_cast<uint32_t>(s.channel * 2 + phase), static_cast<uint32_t>(peer),
                   epoch);
      return false;
    }
  }
}

// Waits until `peer` has written an epoch >= `epoch` into slot [phase][peer] of our own pad.
// Returns false (after recording the error) on timeout.
__device__ __forceinline__ bool wait_peer(const SignalArgs& s, int peer, int phase, uint32_t epoch) {
  return wait_at_least(s, pad_slot(s.pads[s.rank], s.world, s.channel, phase, peer), epoch, peer, phase, epoch);
}

// Block-wide: threads p < world signal rank p (phase slot), nothing else. Caller synchronizes.
__device__ __forceinline__ void block_signal_all(const SignalArgs& s, int phase, uint32_t epoch) {
  if (static_cast<int>(threadIdx.x) < s.world) signal_peer(s, static_cast<int>(threadIdx.x), phase, epoch);
}

// Block-wide: threads p < world each wait for rank p. Returns true when every wait succeeded.
// Contains __syncthreads(): call from all threads of the block.
__device__ __forceinline__ bool block_wait_all(const SignalArgs& s, int phase, uint32_t epoch) {
  int ok = 1;
  if (static_cast<int>(threadIdx.x) < s.world) ok = wait_peer(s, static_cast<int>(threadIdx.x), phase, epoch);
  return __syncthreads_and(ok) != 0;
}

// The "done" half of the reduce-scatter (the gather's is grid_done_counters). Each block calls it
// once, from all threads, after its share of the data movement. The last block to arrive signals
// phase 1 to every rank, waits for every rank's phase-1 signal (skipped if any block of this launch
// failed: the launch is already in error), then resets `arrive` and publishes seq = epoch for the
// next launch. Returns true in that last block (after every other block has passed its start: state
// read at the start may now be rewritten).
__device__ __forceinline__ bool grid_done_barrier(const SignalArgs& s, uint32_t epoch, bool block_failed) {
  __shared__ uint32_t s_total;
  // The block's memory operations (remote stores into peers' buffers, or loads from them that must
  // finish before a peer may reuse its buffer) reach thread 0 through bar.sync, and its system-scope
  // fence is cumulative: all of them are ordered before its arrive. One fence per block, not one per
  // thread (cooperative groups' grid sync does the same at device scope).
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    const uint32_t inc = 1u + (block_failed ? kArriveFailed : 0u);
    const uint32_t total = atomicAdd(s.arrive, inc) + inc;
    // Last block: this fence pairs with the other blocks' fences before their arrive (observed through
    // the atomic), so their operations are ordered before the release stores below.
    if ((total & kArriveCountMask) == gridDim.x) __threadfence_system();
    s_total = total;
  }
  __syncthreads();
  const uint32_t total = s_total;
  if ((total & kArriveCountMask) != gridDim.x) return false;  // not the last block

  // Release stores, cumulative over what thread 0 ordered above (bar.sync): no further fence needed.
  if (static_cast<int>(threadIdx.x) < s.world) {
    st_release_sys(pad_slot(s.pads[threadIdx.x], s.world, s.channel, 1, s.rank), epoch);
  }
  if (total < kArriveFailed) block_wait_all(s, 1, epoch);
  __syncthreads();
  if (threadIdx.x == 0) {
    *s.arrive = 0;
    *reinterpret_cast<volatile uint32_t*>(s.seq) = epoch;
  }
  return true;
}

// The done counter of `src` on `channel` in the pad at `pad_base` (protocol at the top of this file).
__device__ __forceinline__ uint32_t* done_counter(uint64_t pad_base, int channel, int src) {
  return reinterpret_cast<uint32_t*>(pad_base) + kDoneBase + channel * kMaxWorld + src;
}

// This block's share of kDoneQuantum: the shares of blocks 0..gridDim.x-1 sum to it exactly, each >= 1.
__device__ __forceinline__ uint32_t done_share() {
  const uint64_t b = blockIdx.x, g = gridDim.x;
  return static_cast<uint32_t>(((b + 1) * kDoneQuantum) / g - (b * kDoneQuantum) / g);
}

// Returned by grid_done_counters.
constexpr int kNotLast = 0, kLastAllArrived = 1, kLastFailed = 2;

// The done half of the gather, through the done counters (each block calls it once, from all threads,
// after its stores). Every block adds its share to every rank's counter for us (the release reduction
// is cumulative over the block's stores through bar.sync, so no fence and no atomic chain through a
// last block sits between our last store and a peer's wait). The last block to arrive (counted on
// `arrive` only for the bookkeeping) waits until every rank's counter in our pad reached `*received`
// + kDoneQuantum (skipped if any block of this launch failed), then stores the new total, resets
// `arrive` and publishes seq = epoch. Returns, in that last block (after every block has passed its
// start), kLastAllArrived when every rank's counter arrived, kLastFailed when a block of this launch
// failed or a wait timed out; kNotLast in every other block.

__device__ __forceinline__ int grid_done_counters(const SignalArgs& s, uint32_t epoch, uint32_t* received,
                                                  bool block_failed) {
  __shared__ uint32_t s_total;
  __syncthreads();
  const int t = static_cast<int>(threadIdx.x);
  if (t < s.world) red_release_sys_add(done_counter(s.pads[t], s.channel, s.rank), done_share());
  if (t == 0) {
    const uint32_t inc = 1u + (block_failed ? kArriveFailed : 0u);
    s_total = atomicAdd(s.arrive, inc) + inc;
  }
  __syncthreads();
  const uint32_t total = s_total;
  if ((total & kArriveCountMask) != gridDim.x) return kNotLast;

  const uint32_t target = ld_relaxed_gpu(received) + kDoneQuantum;
  int arrived = total < kArriveFailed;
  if (arrived && t < s.world) {
    arrived = wait_at_least(s, done_counter(s.pads[s.rank], s.channel, t), target, t, 1, epoch);
  }
  arrived = __syncthreads_and(arrived);
  if (t == 0) {
    *s.arrive = 0;
    *reinterpret_cast<volatile uint32_t*>(received) = target;
    *reinterpret_cast<volatile uint32_t*>(s.seq) = epoch;
  }
  return arrived ? kLastAllArrived : kLastFailed;
}

}  // namespace nsa_cp
