// An NCCL communicator owned by nsa_cp._C: the NCCL path's uneven collectives without torch's c10d op
// around each call (vLLM's and SGLang's pynccl pattern, in C++ rather than ctypes).
//
// libnccl is not linked: it is opened at run time (dlopen), preferably the copy torch already loaded
// (RTLD_NOLOAD finds it), so the module still imports on machines without NCCL and never mixes two
// NCCL versions in one process. Only the stable part of NCCL's C ABI is declared here (the handful of
// functions below, whose signatures have not changed since NCCL 2.7), so no nccl.h is needed to build.
#include <dlfcn.h>

#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "launch.h"
#include "ops.h"

namespace nsa_cp {
namespace {

// ---- the part of nccl.h we use (ABI-stable) -------------------------------------------------------
using ncclComm_t = void*;
using ncclResult_t = int;  // ncclSuccess = 0, ncclInProgress = 7
using ncclDataType_t = int;
using ncclRedOp_t = int;   // ncclSum = 0
constexpr ncclResult_t kNcclSuccess = 0;
constexpr ncclRedOp_t kNcclSum = 0;
struct ncclUniqueId {
  char internal[kNcclUniqueIdBytes];
};

struct NcclApi {
  void* handle = nullptr;
  std::string path;
  const char* (*GetErrorString)(ncclResult_t) = nullptr;
  const char* (*GetLastError)(ncclComm_t) = nullptr;  // NCCL >= 2.13; may be absent
  ncclResult_t (*GetVersion)(int*) = nullptr;
  ncclResult_t (*GetUniqueId)(ncclUniqueId*) = nullptr;
  ncclResult_t (*CommInitRank)(ncclComm_t*, int, ncclUniqueId, int) = nullptr;
  ncclResult_t (*CommDestroy)(ncclComm_t) = nullptr;
  ncclResult_t (*CommAbort)(ncclComm_t) = nullptr;
  ncclResult_t (*CommGetAsyncError)(ncclComm_t, ncclResult_t*) = nullptr;
  ncclResult_t (*AllGather)(const void*, void*, size_t, ncclDataType_t, ncclComm_t, void*) = nullptr;
  ncclResult_t (*ReduceScatter)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, ncclComm_t, void*) = nullptr;
  ncclResult_t (*Broadcast)(const void*, void*, size_t, ncclDataType_t, int, ncclComm_t, void*) = nullptr;
  ncclResult_t (*Reduce)(const void*, void*, size_t, ncclDataType_t, ncclRedOp_t, int, ncclComm_t, void*) = nullptr;
  ncclResult_t (*GroupStart)() = nullptr;
  ncclResult_t (*GroupEnd)() = nullptr;
};

std::mutex g_api_mutex;
NcclApi g_api;

template <typename F>
void bind_symbol(void* handle, const char* name, F& fn, bool required, const std::string& path) {
  fn = reinterpret_cast<F>(dlsym(handle, name));
  if (!fn && required) {
    throw std::runtime_error("nccl_library: " + path + " has no symbol " + name + " (not an NCCL library?)");
  }
}

// Opens libnccl once per process: `path` when given, else the library already in the process
// (torch's), else the loader's search for libnccl.so.2. Later calls return the same library; a
// different explicit `path` than the one opened is refused.
const NcclApi& api(const std::string& path) {
  std::lock_guard<std::mutex> lock(g_api_mutex);
  if (g_api.handle) {
    if (!path.empty() && path != g_api.path) {
      throw std::invalid_argument("nccl_library: NCCL is already opened from " + g_api.path + ", not " + path);
    }
    return g_api;
  }
  void* handle = nullptr;
  std::string opened = path;
  if (!path.empty()) {
    handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  } else {
    for (const char* name : {"libnccl.so.2", "libnccl.so"}) {
      handle = dlopen(name, RTLD_NOW | RTLD_NOLOAD);  // torch's copy, when it is loaded
      if (!handle) handle = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (handle) {
        opened = name;
        break;
      }
    }
  }
  if (!handle) {
    const char* why = dlerror();
    throw std::runtime_error("nccl_library: cannot open " + (path.empty() ? std::string("libnccl.so.2 or libnccl.so") : path) +
                             ": " + (why ? why : "unknown dlopen error"));
  }
  NcclApi a;
  a.handle = handle;
  a.path = opened;
  bind_symbol(handle, "ncclGetErrorString", a.GetErrorString, true, opened);
  bind_symbol(handle, "ncclGetLastError", a.GetLastError, false, opened);
  bind_symbol(handle, "ncclGetVersion", a.GetVersion, true, opened);
  bind_symbol(handle, "ncclGetUniqueId", a.GetUniqueId, true, opened);
  bind_symbol(handle, "ncclCommInitRank", a.CommInitRank, true, opened);
  bind_symbol(handle, "ncclCommDestroy", a.CommDestroy, true, opened);
  bind_symbol(handle, "ncclCommAbort", a.CommAbort, true, opened);
  bind_symbol(handle, "ncclCommGetAsyncError", a.CommGetAsyncError, true, opened);
  bind_symbol(handle, "ncclAllGather", a.AllGather, true, opened);
  bind_symbol(handle, "ncclReduceScatter", a.ReduceScatter, true, opened);
  bind_symbol(handle, "ncclBroadcast", a.Broadcast, true, opened);
  bind_symbol(handle, "ncclReduce", a.Reduce, true, opened);
  bind_symbol(handle, "ncclGroupStart", a.GroupStart, true, opened);
  bind_symbol(handle, "ncclGroupEnd", a.GroupEnd, true, opened);
  g_api = a;
  return g_api;
}

void check_nccl(const NcclApi& a, ncclResult_t r, ncclComm_t comm, const char* fn, const char* what) {
  if (r == kNcclSuccess) return;
  std::string msg = std::string(fn) + ": " + what + " failed: " + a.GetErrorString(r);
  if (a.GetLastError) {
    const char* last = a.GetLastError(comm);
    if (last && *last) msg += std::string(" (") + last + ")";
  }
  throw std::runtime_error(msg);
}

// NCCL's ncclDataType_t values that a caller may name (ncclInt8 .. ncclBfloat16; the FP8 types of
// NCCL >= 2.24 are moved as ncclUint8).
void check_dtype(const char* fn, int dtype, bool sum) {
  require(dtype >= 0 && dtype <= 9, fn, "dtype must be an ncclDataType_t in [0, 9], got " + std::to_string(dtype));
  require(!sum || dtype >= 6, fn,
          "a sum needs a floating dtype (ncclFloat16 6, ncclFloat32 7, ncclFloat64 8, ncclBfloat16 9), got " +
              std::to_string(dtype));
}

}  // namespace

std::string nccl_library(const std::string& path) { return api(path).path; }

int nccl_version(const std::string& path) {
  const NcclApi& a = api(path);
  int v = 0;
  check_nccl(a, a.GetVersion(&v), nullptr, "nccl_version", "ncclGetVersion");
  return v;
}

std::string nccl_unique_id(const std::string& path) {
  const NcclApi& a = api(path);
  ncclUniqueId id;
  check_nccl(a, a.GetUniqueId(&id), nullptr, "nccl_unique_id", "ncclGetUniqueId");
  return std::string(id.internal, sizeof(id.internal));
}

NcclComm::NcclComm(const std::string& unique_id, int world, int rank, int device, const std::string& library)
    : world_(world), rank_(rank), device_(device) {
  const char* fn = "NcclComm";
  require(unique_id.size() == kNcclUniqueIdBytes, fn,
          "unique_id must hold " + std::to_string(kNcclUniqueIdBytes) + " bytes, got " +
              std::to_string(unique_id.size()));
  require(world >= 1, fn, "world must be >= 1, got " + std::to_string(world));
  require(rank >= 0 && rank < world, fn,
          "rank must be in [0, world=" + std::to_string(world) + "), got " + std::to_string(rank));
  require(device >= 0, fn, "device must be >= 0, got " + std::to_string(device));
  const NcclApi& a = api(library);
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), sizeof(id.internal));
  ncclComm_t comm = nullptr;
  ncclResult_t r;
  {
    DeviceGuard guard(device, fn);
    r = a.CommInitRank(&comm, world, id, rank);  // blocks until every rank has joined
  }
  check_nccl(a, r, nullptr, fn, "ncclCommInitRank");
  comm_ = comm;
}

NcclComm::~NcclComm() {
  // An NCCL communicator must be destroyed collectively (close()); one left open at exit is
  // reclaimed with the process (destroying it here could wait on peers that are gone).
}

void* NcclComm::live(const char* fn) const {
  if (!comm_) throw std::runtime_error(std::string(fn) + ": the NCCL communicator is closed");
  return comm_;
}

namespace {
// Arguments of the equal-count calls, checked before any NCCL call. Returns whether there is data.
bool check_equal(const char* fn, uint64_t send, uint64_t recv, int64_t count, int dtype, bool sum) {
  check_dtype(fn, dtype, sum);
  require(count >= 0, fn, "count must be >= 0, got " + std::to_string(count));
  if (count == 0) return false;
  require_ptr(send, fn, "send");
  require_ptr(recv, fn, "recv");
  return true;
}
}  // namespace

void NcclComm::all_gather(uint64_t send, uint64_t recv, int64_t count, int dtype, uint64_t stream) {
  const char* fn = "NcclComm.all_gather";
  ncclComm_t comm = live(fn);
  if (!check_equal(fn, send, recv, count, dtype, false)) return;
  const NcclApi& a = g_api;
  check_nccl(a, a.AllGather(as_ptr<void>(send), as_ptr<void>(recv), static_cast<size_t>(count), dtype, comm,
                            as_ptr<void>(stream)),
             comm, fn, "ncclAllGather");
}

void NcclComm::pack_all_gather(uint64_t src, int64_t src_row_stride_bytes, int64_t src_rows, uint64_t recv,
                               int64_t rows_per_rank, int64_t row_bytes, uint64_t count, uint64_t stream) {
  const char* fn = "NcclComm.pack_all_gather";
  require(rows_per_rank >= 0, fn, "rows_per_rank must be >= 0, got " + std::to_string(rows_per_rank));
  require(row_bytes > 0, fn, "row_bytes must be > 0, got " + std::to_string(row_bytes));
  ncclComm_t comm = live(fn);
  if (rows_per_rank == 0) return;
  require_ptr(recv, fn, "recv");
  const uint64_t slot = recv + static_cast<uint64_t>(rank_ * rows_per_rank * row_bytes);
  DeviceGuard guard(device_, fn);  // the pack launches on the current device
  pack_rows(src, src_row_stride_bytes, src_rows, slot, row_bytes, rows_per_rank, row_bytes, count, stream);
  // in place: NCCL reads our slot of recv and fills the others
  const NcclApi& a = g_api;
  check_nccl(a, a.AllGather(as_ptr<void>(slot), as_ptr<void>(recv), static_cast<size_t>(rows_per_rank * row_bytes),
                            /*ncclUint8*/ 1, comm, as_ptr<void>(stream)),
             comm, fn, "ncclAllGather");
}

void NcclComm::reduce_scatter(uint64_t send, uint64_t recv, int64_t count, int dtype, uint64_t stream) {
  const char* fn = "NcclComm.reduce_scatter";
  ncclComm_t comm = live(fn);
  if (!check_equal(fn, send, recv, count, dtype, true)) return;
  const NcclApi& a = g_api;
  check_nccl(a, a.ReduceScatter(as_ptr<void>(send), as_ptr<void>(recv), static_cast<size_t>(count), dtype, kNcclSum,
                                comm, as_ptr<void>(stream)),
             comm, fn, "ncclReduceScatter");
}

namespace {
// Arguments of the uneven calls, checked before any NCCL call. Returns whether any rank has elements.
bool check_v(const char* fn, uint64_t send, uint64_t recv, const std::vector<int64_t>& counts,
             const std::vector<int64_t>& offsets, int world, int rank, int64_t elem_bytes, bool gather) {
  require(static_cast<int>(counts.size()) == world, fn,
          "counts must have world=" + std::to_string(world) + " entries, got " + std::to_string(counts.size()));
  require(static_cast<int>(offsets.size()) == world, fn,
          "offsets must have world=" + std::to_string(world) + " entries, got " + std::to_string(offsets.size()));
  require(elem_bytes > 0, fn, "elem_bytes must be > 0, got " + std::to_string(elem_bytes));
  bool any = false;
  for (int q = 0; q < world; ++q) {
    require(counts[q] >= 0 && offsets[q] >= 0, fn,
            "counts and offsets must be >= 0, got counts[" + std::to_string(q) + "]=" + std::to_string(counts[q]) +
                ", offsets[" + std::to_string(q) + "]=" + std::to_string(offsets[q]));
    any = any || counts[q] > 0;
  }
  // gather: every rank's rows land in recv, ours come from send; reduce-scatter: every rank's rows are
  // read from send, ours land in recv
  if (any) require_ptr(gather ? recv : send, fn, gather ? "recv" : "send");
  if (counts[rank] > 0) require_ptr(gather ? send : recv, fn, gather ? "send" : "recv");
  return any;
}

// The uneven collectives: check the arguments, then one NCCL call per rank q with elements, rooted at
// q, grouped into one launch (what torch does for an uneven list collective on NCCL). The group is
// always closed, even after a failed call inside it. gather: all_gather_v (any dtype) or
// reduce_scatter_v (a sum: floating dtypes).
template <typename Call>
void per_root_grouped(const char* fn, const char* what, ncclComm_t comm, uint64_t send, uint64_t recv,
                      const std::vector<int64_t>& counts, const std::vector<int64_t>& offsets, int dtype,
                      int64_t elem_bytes, int world, int rank, bool gather, Call call) {
  check_dtype(fn, dtype, !gather);
  if (!check_v(fn, send, recv, counts, offsets, world, rank, elem_bytes, gather)) return;
  const NcclApi& a = g_api;
  check_nccl(a, a.GroupStart(), comm, fn, "ncclGroupStart");
  ncclResult_t r = kNcclSuccess;
  for (int q = 0; q < static_cast<int>(counts.size()) && r == kNcclSuccess; ++q) {
    if (counts[q] > 0) r = call(a, q);
  }
  ncclResult_t end = a.GroupEnd();
  check_nccl(a, r, comm, fn, what);
  check_nccl(a, end, comm, fn, "ncclGroupEnd");
}
}  // namespace

void NcclComm::all_gather_v(uint64_t send, uint64_t recv, const std::vector<int64_t>& counts,
                            const std::vector<int64_t>& offsets, int dtype, int64_t elem_bytes, uint64_t stream) {
  const char* fn = "NcclComm.all_gather_v";
  ncclComm_t comm = live(fn);
  per_root_grouped(fn, "ncclBroadcast", comm, send, recv, counts, offsets, dtype, elem_bytes, world_, rank_, true,
                   [&](const NcclApi& a, int q) {
                     return a.Broadcast(as_ptr<void>(send),
                                        as_ptr<void>(recv + static_cast<uint64_t>(offsets[q] * elem_bytes)),
                                        static_cast<size_t>(counts[q]), dtype, q, comm, as_ptr<void>(stream));
                   });
}

void NcclComm::reduce_scatter_v(uint64_t send, uint64_t recv, const std::vector<int64_t>& counts,
                                const std::vector<int64_t>& offsets, int dtype, int64_t elem_bytes, uint64_t stream) {
  const char* fn = "NcclComm.reduce_scatter_v";
  ncclComm_t comm = live(fn);
  per_root_grouped(fn, "ncclReduce", comm, send, recv, counts, offsets, dtype, elem_bytes, world_, rank_, false,
                   [&](const NcclApi& a, int q) {
                     return a.Reduce(as_ptr<void>(send + static_cast<uint64_t>(offsets[q] * elem_bytes)),
                                     as_ptr<void>(recv), static_cast<size_t>(counts[q]), dtype, kNcclSum, q, comm,
                                     as_ptr<void>(stream));
                   });
}

std::string NcclComm::async_error() const {
  if (!comm_) return "";
  const NcclApi& a = g_api;
  ncclResult_t state = kNcclSuccess;
  ncclResult_t r = a.CommGetAsyncError(comm_, &state);
  if (r != kNcclSuccess) return std::string("ncclCommGetAsyncError failed: ") + a.GetErrorString(r);
  return state == kNcclSuccess ? "" : a.GetErrorString(state);
}

void NcclComm::close(bool abort) {
  if (!comm_) return;
  ncclComm_t comm = comm_;
  comm_ = nullptr;  // refused from now on, whatever destroy says
  const NcclApi& a = g_api;
  ncclResult_t r;
  {
    DeviceGuard guard(device_, "NcclComm.close");
    r = abort ? a.CommAbort(comm) : a.CommDestroy(comm);
  }
  check_nccl(a, r, nullptr, "NcclComm.close", abort ? "ncclCommAbort" : "ncclCommDestroy");
}

}  // namespace nsa_cp
