// Device queries and host-mapped memory: small wrappers over the CUDA runtime that fail cleanly
// (an exception, never a crash) on a machine without a GPU or driver.
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "launch.h"

namespace nsa_cp {
namespace {

// Registry of host-mapped allocations: lets read_u32 / write_u32 / free_host_mapped check the
// pointer and the index instead of trusting an integer from Python.
std::mutex g_mapped_mutex;
std::unordered_map<uint64_t, int64_t> g_mapped;  // host pointer -> number of uint32

int64_t mapped_size(const char* fn, uint64_t host_ptr) {
  std::lock_guard<std::mutex> lock(g_mapped_mutex);
  const auto it = g_mapped.find(host_ptr);
  require(it != g_mapped.end(), fn, "host_ptr is not an allocation of alloc_host_mapped_u32 (or was freed)");
  return it->second;
}

void require_index(const char* fn, int64_t index, int64_t n) {
  if (index < 0 || index >= n) {
    throw std::out_of_range(std::string(fn) + ": index " + std::to_string(index) + " out of range for " +
                            std::to_string(n) + " uint32");
  }
}

bool means_no_gpu(cudaError_t e) { return e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver; }

}  // namespace

int device_count() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (means_no_gpu(e)) {
    cudaGetLastError();  // not sticky, but leave nothing behind for the next check_launch
    return 0;
  }
  check_cuda(e, "device_count", "cudaGetDeviceCount");
  return n;
}

std::string device_status() {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e == cudaSuccess) return n > 0 ? "ok" : "cudaErrorNoDevice: no CUDA-capable device is detected";
  cudaGetLastError();
  std::string msg = std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
  if (e == cudaErrorInsufficientDriver) {
    // Tell "no driver at all" (a GPU-less builder) from "driver older than our static runtime".
    const int drv = driver_version();
    const auto ver = [](int v) { return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10); };
    msg += drv == 0 ? " (no NVIDIA driver found: libcuda.so.1 is missing)"
                    : " (the driver supports CUDA " + ver(drv) + ", this module needs " + ver(CUDART_VERSION) + ")";
  }
  return msg;
}

bool can_access_peer(int device, int peer) {
  require(device >= 0 && peer >= 0, "can_access_peer",
          "device indices must be >= 0, got " + std::to_string(device) + ", " + std::to_string(peer));
  if (device == peer) return true;
  int ok = 0;
  check_cuda(cudaDeviceCanAccessPeer(&ok, device, peer), "can_access_peer", "cudaDeviceCanAccessPeer");
  return ok != 0;
}

void enable_peer_access(int device, int peer) {
  constexpr const char* fn = "enable_peer_access";
  require(device >= 0 && peer >= 0, fn,
          "device indices must be >= 0, got " + std::to_string(device) + ", " + std::to_string(peer));
  if (device == peer) return;
  int previous = 0;
  check_cuda(cudaGetDevice(&previous), fn, "cudaGetDevice");
  check_cuda(cudaSetDevice(device), fn, "cudaSetDevice");
  const cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) (void)cudaGetLastError();  // idempotent; clear the (non-sticky) error
  cudaSetDevice(previous);
  if (e != cudaErrorPeerAccessAlreadyEnabled) check_cuda(e, fn, "cudaDeviceEnablePeerAccess");
}

std::pair<uint64_t, uint64_t> alloc_host_mapped_u32(int64_t n) {
  constexpr const char* fn = "alloc_host_mapped_u32";
  require(n > 0 && n <= (int64_t{1} << 30), fn, "n must be in [1, 2^30], got " + std::to_string(n));
  void* host = nullptr;
  // Portable: usable from every device's context; mapped: kernels write it directly.
  check_cuda(cudaHostAlloc(&host, static_cast<size_t>(n) * sizeof(uint32_t), cudaHostAllocMapped | cudaHostAllocPortable),
             fn, "cudaHostAlloc");
  std::memset(host, 0, static_cast<size_t>(n) * sizeof(uint32_t));
  void* dev = nullptr;
  const cudaError_t e = cudaHostGetDevicePointer(&dev, host, 0);
  if (e != cudaSuccess) {
    cudaFreeHost(host);
    check_cuda(e, fn, "cudaHostGetDevicePointer");
  }
  const uint64_t h = reinterpret_cast<uintptr_t>(host);
  {
    std::lock_guard<std::mutex> lock(g_mapped_mutex);
    g_mapped[h] = n;
  }
  return {h, reinterpret_cast<uintptr_t>(dev)};
}

void free_host_mapped(uint64_t host_ptr) {
  constexpr const char* fn = "free_host_mapped";
  mapped_size(fn, host_ptr);
  {
    std::lock_guard<std::mutex> lock(g_mapped_mutex);
    g_mapped.erase(host_ptr);
  }
  check_cuda(cudaFreeHost(as_ptr<void>(host_ptr)), fn, "cudaFreeHost");
}

uint32_t read_u32(uint64_t host_ptr, int64_t index) {
  require_index("read_u32", index, mapped_size("read_u32", host_ptr));
  // volatile: the GPU writes this memory behind the compiler's back.
  return as_ptr<volatile uint32_t>(host_ptr)[index];
}

void write_u32(uint64_t host_ptr, int64_t index, uint32_t value) {
  require_index("write_u32", index, mapped_size("write_u32", host_ptr));
  as_ptr<volatile uint32_t>(host_ptr)[index] = value;
}

int runtime_version() {
  int v = 0;
  if (cudaRuntimeGetVersion(&v) != cudaSuccess) v = CUDART_VERSION;
  return v;
}

int driver_version() {
  int v = 0;
  if (cudaDriverGetVersion(&v) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return v;
}

std::vector<KernelInfo> kernel_info() {
  std::vector<KernelInfo> out;
  append_kernel_info_barrier(out);
  append_kernel_info_gather(out);
  append_kernel_info_reduce_scatter(out);
  append_kernel_info_row_copy(out);
  return out;
}

}  // namespace nsa_cp
