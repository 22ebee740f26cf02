// pybind11 bindings of nsa_cp._C. Torch-free on purpose: device addresses (tensor.data_ptr()),
// signal pads and streams (torch.cuda.Stream.cuda_stream) are plain Python ints, so one wheel serves
// any torch build. Launch functions release the GIL; they only enqueue work on `stream`.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "codes.h"
#include "ops.h"

namespace py = pybind11;

#ifndef NSA_CP_CUDA_ARCHS
#define NSA_CP_CUDA_ARCHS "unknown"
#endif

static const char* kModuleDoc = R"doc(
nsa_cp._C: CUDA kernels for intranode context-parallel collectives (torch-free).

Pointers are device addresses as ints (``tensor.data_ptr()``); ``stream`` is a cudaStream_t as an
int (``torch.cuda.current_stream().cuda_stream``) and must belong to the current CUDA device.
Bad arguments raise ValueError before any CUDA call; CUDA failures raise RuntimeError.

Signal protocol shared by all kernels. Each rank has a symmetric uint32 "signal pad" that peers
write through mapped pointers; ``pads`` is a device uint64[world] holding every rank's pad base as
mapped into this process (pads[rank] is our own). A call on channel c uses, in every pad, the slots
``pad[(c*2 + phase)*world + src]``: phase 0 = entered, phase 1 = done, below word DONE_BASE, and the
gather's done counters ``pad[DONE_BASE + c*MAX_WORLD + src]`` above it. Pads hold SIGNAL_WORDS uint32.
Channels that may run concurrently need distinct channel numbers.

``seq`` (device uint32, one per channel, local memory) holds the last finished epoch; a launch uses
epoch = seq + 1 and its last block stores seq = epoch. ``arrive`` (device uint32, one per channel)
counts finished blocks and is reset by the last one. Zero pads, seq and arrive once before first use,
on every rank. Waits compare wrap-safely, so epochs may wrap around.

``timeout_ns`` bounds every wait (0 = wait forever). On timeout the first error is written to ``err``
(device address of a host-mapped uint32[4], see alloc_host_mapped_u32) as
{ERR_TIMEOUT, channel*2 + phase, peer rank waited for, epoch} and the kernel gives up instead of
hanging; ERR_BAD_DEVICE_ARG records device-side arguments that were unusable (counts outside
[0, max_rank_len], offsets not the prefix sum of counts, more rows than positions, null or misaligned
buffers) with the rank whose entry was bad; ERR_BAD_POSITION an ordered call's position outside
[0, num_positions) (clamped: nothing outside the buffers is touched) with the rank that read it. Read err after synchronizing the stream. After any error the channel's state
(pads, seq) differs between ranks: zero it again on every rank before reusing the channel.
)doc";

PYBIND11_MODULE(_C, m) {
  m.doc() = kModuleDoc;

  m.attr("MAX_WORLD") = nsa_cp::kMaxWorld;
  m.attr("MAX_BLOCKS") = nsa_cp::kMaxBlocks;
  m.attr("THREADS_PER_BLOCK") = nsa_cp::kDataThreads;
  m.attr("SIGNAL_WORDS") = nsa_cp::kSignalWords;
  m.attr("DONE_BASE") = nsa_cp::kDoneBase;
  m.attr("DONE_QUANTUM") = nsa_cp::kDoneQuantum;
  m.attr("ERR_NONE") = nsa_cp::kErrNone;
  m.attr("ERR_TIMEOUT") = nsa_cp::kErrTimeout;
  m.attr("ERR_BAD_DEVICE_ARG") = nsa_cp::kErrBadDeviceArg;
  m.attr("ERR_BAD_POSITION") = nsa_cp::kErrBadPosition;
  m.attr("ERR_LAYOUT_MISMATCH") = nsa_cp::kErrLayoutMismatch;
  m.attr("ERR_RECORD_WORDS") = nsa_cp::kErrRecordWords;
  m.attr("FP_BASE") = nsa_cp::kFpBase;
  m.attr("FP_WORDS") = nsa_cp::kFpWords;
  py::list formats;
  for (int i = 0; i < nsa_cp::kQuantCount; ++i) {
    const nsa_cp::QuantCode& q = nsa_cp::kQuantCodes[i];
    m.attr(q.name) = q.code;
    formats.append(py::dict(py::arg("name") = q.name, py::arg("code") = q.code, py::arg("group") = q.group,
                            py::arg("max") = q.max, py::arg("amax_floor") = q.amax_floor,
                            py::arg("scale_floor") = q.scale_floor, py::arg("pow2_scales") = q.pow2_scales));
  }
  m.attr("WIRE_FORMATS") = formats;  // every format's traits (csrc/codes.h), for nsa_cp/geometry/wire.py to compare
  m.attr("DTYPE_BF16") = static_cast<int>(nsa_cp::kBF16);
  m.attr("DTYPE_FP16") = static_cast<int>(nsa_cp::kFP16);
  m.attr("DTYPE_FP32") = static_cast<int>(nsa_cp::kFP32);
  m.attr("CUDA_ARCHS") = NSA_CP_CUDA_ARCHS;  // archs compiled in, e.g. "90a;100a"

  // ---- queries --------------------------------------------------------------------------------
  m.def("device_count", &nsa_cp::device_count,
        "Number of visible CUDA devices; 0 when there is no GPU or no (recent enough) driver.\n"
        "Raises RuntimeError on any other CUDA failure. Initializes the CUDA driver in this process.");
  m.def("device_status", &nsa_cp::device_status,
        "'ok' when a CUDA device is usable, else the CUDA error name and text explaining why not.");
  m.def("can_access_peer", &nsa_cp::can_access_peer, py::arg("device"), py::arg("peer"),
        "True if `device` can map memory of `peer` (cudaDeviceCanAccessPeer; a device reaches itself).\n"
        "Raises RuntimeError without a GPU, ValueError for negative indices.");
  m.def("enable_peer_access", &nsa_cp::enable_peer_access, py::arg("device"), py::arg("peer"),
        "Let kernels on `device` access memory of `peer` (cudaDeviceEnablePeerAccess; idempotent, a no-op\n"
        "for device == peer). Raises RuntimeError without a GPU, ValueError for negative indices.");
  m.def("runtime_version", &nsa_cp::runtime_version,
        "CUDA runtime linked into the module (statically), e.g. 13000 for 13.0.");
  m.def("driver_version", &nsa_cp::driver_version, "CUDA version the driver supports, e.g. 13000; 0 without one.");
  m.def(
      "kernel_info",
      []() {
        py::list out;
        for (const auto& k : nsa_cp::kernel_info()) {
          py::dict d;
          d["name"] = k.name;
          d["num_regs"] = k.num_regs;
          d["local_bytes"] = k.local_bytes;
          d["shared_bytes"] = k.shared_bytes;
          d["max_threads"] = k.max_threads;
          d["binary_version"] = k.binary_version;
          d["ptx_version"] = k.ptx_version;
          out.append(d);
        }
        return out;
      },
      "Loads every kernel on the current device and returns its attributes (registers, local memory\n"
      "bytes per thread, static shared bytes, max threads, binary/PTX arch). Call it once before\n"
      "CUDA-graph capture so no module loading happens inside the capture.");

  // ---- host-mapped memory (error records) -------------------------------------------------------
  m.def("alloc_host_mapped_u32", &nsa_cp::alloc_host_mapped_u32, py::arg("n"),
        "Allocate n zeroed uint32 of pinned, device-mapped host memory (cudaHostAlloc, mapped|portable).\n"
        "Returns (host_ptr, device_ptr): kernels take device_ptr (e.g. as `err`), the host reads with\n"
        "read_u32(host_ptr, i). Free with free_host_mapped(host_ptr). RuntimeError without a GPU.");
  m.def("free_host_mapped", &nsa_cp::free_host_mapped, py::arg("host_ptr"),
        "Free an allocation of alloc_host_mapped_u32 (ValueError if host_ptr is not one).");
  m.def("read_u32", &nsa_cp::read_u32, py::arg("host_ptr"), py::arg("index"),
        "Read element `index` of a host-mapped uint32 array (volatile load; IndexError if out of range).");
  m.def("write_u32", &nsa_cp::write_u32, py::arg("host_ptr"), py::arg("index"), py::arg("value"),
        "Write element `index` of a host-mapped uint32 array, e.g. 0 to reset an error record.");

  // ---- stateless launchers --------------------------------------------------------------------------
  // The library launches through P2PState only. These three stay for the native layer's own tests
  // (tests/native/test_native_gpu.py drives the kernels with simulated ranks in one process, the protocol
  // and timeouts included; tests/native/test_native_launchers.py checks their arguments without a GPU).
  m.def("barrier", &nsa_cp::barrier, py::arg("pads"), py::arg("rank"), py::arg("world"), py::arg("channel"),
        py::arg("phase"), py::arg("seq"), py::arg("advance"), py::arg("timeout_ns"), py::arg("err"),
        py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
        R"doc(Enqueue one phase of the signal protocol on `stream` (one block of 32 threads).

Every rank writes epoch = seq + 1 into slot [channel][phase][rank] of every rank's pad, then waits
until all ranks did the same. Used around copy-engine transfers: barrier(phase=0, advance=False),
the cudaMemcpyAsync pushes, then barrier(phase=1, advance=True).

pads: device address of uint64[world], every rank's pad base (mapped). rank, world: 0 <= rank <
world <= 8. channel: >= 0. phase: 0 (entered) or 1 (done). seq: device address of this channel's
uint32 epoch counter. advance: store seq = epoch at the end. timeout_ns: wait bound in nanoseconds,
0 = forever. err: device address of host-mapped uint32[4]. stream: cudaStream_t as int.)doc");

  m.def("p2p_gather", &nsa_cp::p2p_gather, py::arg("src"), py::arg("src_row_stride_bytes"), py::arg("row_bytes"),
        py::arg("bufs"), py::arg("counts"), py::arg("offsets"), py::arg("max_rank_len"), py::arg("compact"),
        py::arg("rank"), py::arg("world"), py::arg("pads"), py::arg("channel"), py::arg("seq"), py::arg("arrive"),
        py::arg("timeout_ns"), py::arg("err"), py::arg("num_blocks"), py::arg("stream"), py::arg("buffer"),
        py::arg("state"), py::call_guard<py::gil_scoped_release>(),
        R"doc(Enqueue an all-gather of uneven shards that pushes this rank's rows into every rank's buffer.

One launch: entered barrier (phase 0: no peer still reads its buffer from the previous call); copy
our counts[rank] rows from src into every rank's gather buffer (ourselves included) at row
offsets[rank] (compact) or rank*max_rank_len (padded); padded layout only: zero the padding rows
[q*M + counts[q], (q+1)*M) of every slot q of OUR OWN buffer (padding never crosses a link); done
barrier (phase 1: every rank's rows have landed in our buffer). Counts and offsets are read from
device memory, so CUDA-graph replays may change them; size the buffers and the grid for capacity.

src: device address of our shard, row r at src + r*src_row_stride_bytes (may be 0 only when
counts[rank] == 0). src_row_stride_bytes: bytes between source rows (>= 0; 0 repeats one row).
row_bytes: bytes per row (> 0); gather buffers are dense, row stride row_bytes. 16-byte loads/stores when src,
its stride and row_bytes are 16-byte aligned, else 4-byte words, else bytes; buffer bases must be
aligned to the width used. bufs: device address of uint64[world], every rank's gather buffer base
(mapped; bufs[rank] is ours). counts, offsets: device addresses of int32[world] (offsets only used,
and may be 0, when compact is False). max_rank_len: M, rows per rank slot, >= every count.
compact: compact (True) or padded (False) layout. rank, world, pads, channel, seq, arrive,
timeout_ns, err: the signal protocol (module doc). num_blocks: grid size, 1..65535, 512 threads
each. stream: cudaStream_t as int.

buffer: 0 or 1, the tag of the buffers bufs points at, the same on every rank (always 0 with one set
of buffers). state: device address of this rank's uint32[2] (local memory, zero-initialised, one per
channel, updated by every launch): [0] the tag the previous gather wrote: when it differs from
buffer the entered barrier is skipped (the previous gather's done phase already proved every peer
finished with what that buffer holds; every rank must pass the same tags, so nobody waits for the
signal either); [1] the done-counter total this rank has consumed.
The done phase: every block adds its share of DONE_QUANTUM to its counter in every rank's pad
(pads hold SIGNAL_WORDS words); the last block waits until every rank's reached [1] + DONE_QUANTUM.)doc");

  m.def("p2p_reduce_scatter", &nsa_cp::p2p_reduce_scatter, py::arg("out"), py::arg("out_row_stride_bytes"),
        py::arg("bufs"), py::arg("counts"), py::arg("offsets"), py::arg("max_rank_len"), py::arg("compact"),
        py::arg("hidden"), py::arg("dtype"), py::arg("rank"), py::arg("world"), py::arg("pads"), py::arg("channel"),
        py::arg("seq"), py::arg("arrive"), py::arg("timeout_ns"), py::arg("err"), py::arg("num_blocks"),
        py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
        R"doc(Enqueue a reduce-scatter of uneven shards that pulls this rank's rows from every rank.

One launch: entered barrier (phase 0: every rank's partials are complete); then
out[i, :] = sum over p = 0..world-1, in that order, of bufs[p][src0 + i, :] for i < counts[rank],
src0 = offsets[rank] (compact) or rank*max_rank_len (padded), accumulated in fp32 and rounded to
dtype once; done barrier (phase 1: no rank overwrites its reduce buffer while a peer still reads it).

out: device address of our [counts[rank], hidden] result, row i at out + i*out_row_stride_bytes (may
be 0 only when counts[rank] == 0). out_row_stride_bytes: bytes between output rows (>= hidden *
element size). bufs: device address of uint64[world], every rank's reduce buffer base (mapped),
dense rows of hidden elements. counts, offsets, max_rank_len, compact: as in p2p_gather. hidden:
elements per row (> 0). dtype: 0 bfloat16, 1 float16, 2 float32 (DTYPE_* constants). 16-byte loads
when out, its stride and the row size are 16-byte aligned (buffer bases must then be too), else one
element at a time. rank, world, pads, channel, seq, arrive, timeout_ns, err: the signal protocol
(module doc). num_blocks: grid size, 1..65535, 512 threads each. stream: cudaStream_t as int.)doc");

  nsa_cp::bind_p2p_state(m);  // the P2P transport's state: bindings_p2p_state.cpp

  // ---- the NCCL communicator owned by the module --------------------------------------------------
  m.attr("NCCL_UNIQUE_ID_BYTES") = nsa_cp::kNcclUniqueIdBytes;
  m.def("nccl_library", &nsa_cp::nccl_library, py::arg("library") = "",
        "Open libnccl (once per process) and return what was opened. library: a path, or '' for the copy\n"
        "already loaded in the process (torch's), else the loader's libnccl.so.2. RuntimeError when it\n"
        "cannot be opened or lacks a symbol; ValueError for a path other than the one already opened.");
  m.def("nccl_version", &nsa_cp::nccl_version, py::arg("library") = "", "ncclGetVersion (e.g. 22809 for 2.28.9).");
  m.def(
      "nccl_unique_id", [](const std::string& library) { return py::bytes(nsa_cp::nccl_unique_id(library)); },
      py::arg("library") = "", "ncclGetUniqueId: NCCL_UNIQUE_ID_BYTES bytes, made on one rank and sent to all.");
  py::class_<nsa_cp::NcclComm>(m, "NcclComm", R"doc(An NCCL communicator owned by nsa_cp._C (the pynccl pattern).

NcclComm(unique_id, world, rank, device, library=''): ncclCommInitRank on CUDA device `device`;
blocks (GIL released) until all `world` ranks have joined with the same unique_id (nccl_unique_id()
of one rank). Collectives take device addresses as ints, element counts of the ncclDataType_t
`dtype` (ncclInt8 0, ncclUint8 1, ncclInt32 2, ncclUint32 3, ncclInt64 4, ncclUint64 5,
ncclFloat16 6, ncclFloat32 7, ncclFloat64 8, ncclBfloat16 9) and a cudaStream_t of `device`; they
enqueue and return (GIL released), and are captured by CUDA graphs like any NCCL call. The caller
makes `device` current. Bad arguments: ValueError before any NCCL call. NCCL failures: RuntimeError.
close() is collective; close(abort=True) is not, for error paths.)doc")
      .def(py::init<const std::string&, int, int, int, const std::string&>(), py::arg("unique_id"), py::arg("world"),
           py::arg("rank"), py::arg("device"), py::arg("library") = "", py::call_guard<py::gil_scoped_release>())
      .def("all_gather", &nsa_cp::NcclComm::all_gather, py::arg("send"), py::arg("recv"), py::arg("count"),
           py::arg("dtype"), py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
           "ncclAllGather of `count` elements per rank into recv [world * count] (send may be our slot of recv).")
      .def("pack_all_gather", &nsa_cp::NcclComm::pack_all_gather, py::arg("src"), py::arg("src_row_stride_bytes"),
           py::arg("src_rows"), py::arg("recv"), py::arg("rows_per_rank"), py::arg("row_bytes"), py::arg("count"),
           py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
           "pack_rows of src into our slot of the dense recv [world * rows_per_rank rows of row_bytes] (count:\n"
           "device int32, rows past it zeroed), then the in-place ncclAllGather: the padded gather in one call.")
      .def("reduce_scatter", &nsa_cp::NcclComm::reduce_scatter, py::arg("send"), py::arg("recv"), py::arg("count"),
           py::arg("dtype"), py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
           "ncclReduceScatter (sum) of send [world * count] into recv [count]; dtype a floating type.")
      .def("all_gather_v", &nsa_cp::NcclComm::all_gather_v, py::arg("send"), py::arg("recv"), py::arg("counts"),
           py::arg("offsets"), py::arg("dtype"), py::arg("elem_bytes"), py::arg("stream"),
           py::call_guard<py::gil_scoped_release>(),
           "Uneven all-gather: rank q's counts[q] elements land at recv + offsets[q]*elem_bytes (grouped\n"
           "ncclBroadcast rooted at each rank with elements; send holds our counts[rank]).")
      .def("reduce_scatter_v", &nsa_cp::NcclComm::reduce_scatter_v, py::arg("send"), py::arg("recv"),
           py::arg("counts"), py::arg("offsets"), py::arg("dtype"), py::arg("elem_bytes"), py::arg("stream"),
           py::call_guard<py::gil_scoped_release>(),
           "Uneven reduce-scatter: recv [counts[rank]] = the sum over ranks of their send + offsets[rank]*elem_bytes\n"
           "(grouped ncclReduce rooted at each rank with elements).")
      .def("async_error", &nsa_cp::NcclComm::async_error, "'' while healthy, else NCCL's asynchronous error.")
      .def("close", &nsa_cp::NcclComm::close, py::arg("abort") = false, py::call_guard<py::gil_scoped_release>(),
           "Destroy the communicator (collective), or abort it (abort=True, local); later calls raise.")
      .def_property_readonly("closed", &nsa_cp::NcclComm::closed)
      .def_property_readonly("rank", &nsa_cp::NcclComm::rank)
      .def_property_readonly("world", &nsa_cp::NcclComm::world)
      .def_property_readonly("device", &nsa_cp::NcclComm::device);

  m.def("pack_rows", &nsa_cp::pack_rows, py::arg("src"), py::arg("src_row_stride_bytes"), py::arg("src_rows"),
        py::arg("dst"), py::arg("dst_row_stride_bytes"), py::arg("dst_rows"), py::arg("row_bytes"), py::arg("count"),
        py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
        R"doc(Enqueue dst[r] = src[r] for r < n and dst[r] = 0 for n <= r < dst_rows (one launch).

n = *count (device int32, read on the device, so CUDA-graph replays may change it), clamped to
[0, min(src_rows, dst_rows)]: no row outside either tensor is read or written. src, dst: device
addresses of row 0; rows r at base + r*row_stride_bytes (strides >= row_bytes). row_bytes: bytes per
row (> 0). 16-byte words when both bases, both strides and row_bytes are 16-byte aligned, else 4, else
1. src may be 0 when src_rows == 0. stream: cudaStream_t as int.)doc");

  m.def("padded_compact", &nsa_cp::padded_compact, py::arg("padded"), py::arg("padded_row_stride_bytes"),
        py::arg("compact"), py::arg("compact_row_stride_bytes"), py::arg("compact_rows"), py::arg("row_bytes"),
        py::arg("counts"), py::arg("offsets"), py::arg("max_rank_len"), py::arg("world"), py::arg("to_compact"),
        py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
        R"doc(Enqueue the conversion between the padded and the compact layout (one launch).

padded: [world * max_rank_len] rows, rank q's slot at rows q*M..(q+1)*M; compact: [compact_rows]
rows, rank q's at offsets[q]... counts, offsets: device int32[world] (read on the device); every
count is clamped to [0, M]. to_compact: compact[offsets[q] + r] = padded[q*M + r] for r < counts[q];
else the reverse, and every other row of the padded buffer is written with zeros. Rows whose
compact index falls outside [0, compact_rows) are never touched (their padded rows get zeros).
Strides, alignment, stream: as in pack_rows.)doc");
}
