// Host-side helpers shared by the launchers in csrc/*.cu: argument checks that run before any CUDA
// call (so they work, and can be tested, without a GPU) and CUDA error reporting.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <cuda_runtime.h>

#include "common.cuh"
#include "ops.h"

namespace nsa_cp {

// Bad argument from the caller: std::invalid_argument becomes ValueError in Python.
inline void require(bool ok, const char* fn, const std::string& what) {
  if (!ok) throw std::invalid_argument(std::string(fn) + ": " + what);
}

inline void require_ptr(uint64_t ptr, const char* fn, const char* name) {
  require(ptr != 0, fn, std::string(name) + " must be a non-null device pointer");
}

// CUDA failure: std::runtime_error becomes RuntimeError in Python.
inline void check_cuda(cudaError_t e, const char* fn, const char* what) {
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string(fn) + ": " + what + " failed: " + cudaGetErrorName(e) + ": " +
                             cudaGetErrorString(e));
  }
}

// After a <<<>>> launch: a bad configuration or a missing kernel image surfaces here, not later.
inline void check_launch(const char* fn) { check_cuda(cudaGetLastError(), fn, "kernel launch"); }

// Makes `device` current for the launches of one call; restores the previous device after.
class DeviceGuard {
 public:
  DeviceGuard(int device, const char* fn) {
    check_cuda(cudaGetDevice(&previous_), fn, "cudaGetDevice");
    if (previous_ == device) {
      previous_ = -1;
    } else {
      check_cuda(cudaSetDevice(device), fn, "cudaSetDevice");
    }
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

inline cudaStream_t as_stream(uint64_t stream) { return reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(stream)); }

template <typename T>
inline T* as_ptr(uint64_t p) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(p));
}

// Checks shared by every kernel that takes part in the signal protocol, then packs them.
inline SignalArgs make_signal_args(const char* fn, uint64_t pads, int rank, int world, int channel, uint64_t seq,
                                   uint64_t arrive, bool need_arrive, uint64_t timeout_ns, uint64_t err) {
  require(world >= 1 && world <= kMaxWorld, fn,
          "world must be in [1, " + std::to_string(kMaxWorld) + "], got " + std::to_string(world));
  require(rank >= 0 && rank < world, fn,
          "rank must be in [0, world=" + std::to_string(world) + "), got " + std::to_string(rank));
  // channel*2+phase slots of `world` entries each, below the done counters of the pad
  require(channel >= 0 && (channel * 2 + 2) * world <= kDoneBase, fn,
          "channel must be in [0, " + std::to_string(kDoneBase / (2 * world)) + ") at world " + std::to_string(world) +
              " (the pad's epoch slots), got " + std::to_string(channel));
  require_ptr(pads, fn, "pads (device uint64[world] of pad bases)");
  require_ptr(seq, fn, "seq (device uint32)");
  if (need_arrive) require_ptr(arrive, fn, "arrive (device uint32)");
  require_ptr(err, fn, "err (device address of a host-mapped uint32[4])");
  SignalArgs s;
  s.pads = as_ptr<const uint64_t>(pads);
  s.rank = rank;
  s.world = world;
  s.channel = channel;
  s.seq = as_ptr<uint32_t>(seq);
  s.arrive = as_ptr<uint32_t>(arrive);
  s.timeout_ns = timeout_ns;
  s.err = as_ptr<uint32_t>(err);
  return s;
}

// The data kernels' layout arguments: every rank's buffer bases and counts (and compact offsets), a
// max_rank_len that fits int32, and buffers of world * max_rank_len rows of row_bytes (> 0, checked by
// the caller) whose byte offsets, and those of the local tensor's rows at `row_stride`, fit int64.
inline void require_layout_args(const char* fn, uint64_t bufs, const char* bufs_what, uint64_t counts,
                                uint64_t offsets, bool compact, int64_t max_rank_len, int world, int64_t row_bytes,
                                int64_t row_stride) {
  require_ptr(bufs, fn, bufs_what);
  require_ptr(counts, fn, "counts (device int32[world])");
  if (compact) require_ptr(offsets, fn, "offsets (device int32[world], needed with compact=True)");
  require(max_rank_len >= 0 && max_rank_len <= INT32_MAX, fn,
          "max_rank_len must be in [0, 2^31), got " + std::to_string(max_rank_len));
  require(max_rank_len <= INT64_MAX / (static_cast<int64_t>(world) * row_bytes) &&
              row_stride <= INT64_MAX / (max_rank_len + 1),
          fn, "buffer size in bytes overflows int64");
}

// The gather's done counters of `channel` must fit in the pad.
inline void require_done_channel(const char* fn, int channel) {
  require(kDoneBase + (channel + 1) * kMaxWorld <= kSignalWords, fn,
          "channel must be < " + std::to_string((kSignalWords - kDoneBase) / kMaxWorld) +
              " (the pad's done counters), got " + std::to_string(channel));
}

inline void require_blocks(const char* fn, int num_blocks) {
  require(num_blocks >= 1 && num_blocks <= kMaxBlocks, fn,
          "num_blocks must be in [1, " + std::to_string(kMaxBlocks) + "], got " + std::to_string(num_blocks));
}

// Largest vector width in {16, 4, 1} bytes that divides every value.
inline int common_alignment(std::initializer_list<uint64_t> values) {
  uint64_t bits = 0;
  for (uint64_t v : values) bits |= v;
  if (bits % 16 == 0) return 16;
  if (bits % 4 == 0) return 4;
  return 1;
}

// Calls f(std::integral_constant<int, W>{}) for the word width W in {16, 4, 1} that `vec` names (any other
// value: 1), so a launcher instantiates its kernel template once per width in one place.
template <typename F>
inline void with_word_width(int vec, F&& f) {
  switch (vec) {
    case 16:
      f(std::integral_constant<int, 16>{});
      break;
    case 4:
      f(std::integral_constant<int, 4>{});
      break;
    default:
      f(std::integral_constant<int, 1>{});
      break;
  }
}

// Each kernel family adds its kernels' attributes (kernel_info() in runtime.cu collects them).
void append_kernel_info_barrier(std::vector<KernelInfo>& out);
void append_kernel_info_gather(std::vector<KernelInfo>& out);
void append_kernel_info_reduce_scatter(std::vector<KernelInfo>& out);
void append_kernel_info_row_copy(std::vector<KernelInfo>& out);

template <typename Kernel>
inline void append_kernel_info(std::vector<KernelInfo>& out, const char* name, Kernel* kernel) {
  cudaFuncAttributes a{};
  check_cuda(cudaFuncGetAttributes(&a, reinterpret_cast<const void*>(kernel)), "kernel_info",
             "cudaFuncGetAttributes");
  out.push_back(KernelInfo{name, a.numRegs, static_cast<int>(a.localSizeBytes), static_cast<int>(a.sharedSizeBytes),
                           a.maxThreadsPerBlock, a.binaryVersion, a.ptxVersion});
}

}  // namespace nsa_cp
