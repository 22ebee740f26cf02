// pybind11 bindings of nsa_cp._C. Torch-free on purpose: device addresses (tensor.data_ptr()),
// signal pads and streams (torch.cuda.Stream.cuda_stream) are plain Python ints, so one wheel serves
// any torch build. Launch functions release the GIL; they only enqueue work on `stream`.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

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
  for (const nsa_cp::QuantCode& q : nsa_cp::kQuantCodes) m.attr(q.name) = q.code;
  m.attr("FP8_GROUP") = nsa_cp::kFp8Group;
  m.attr("FP8_MAX") = nsa_cp::kFp8Max;
  m.attr("FP8_AMAX_FLOOR") = nsa_cp::kFp8AmaxFloor;
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

  // ---- the P2P transport's state, bound once ------------------------------------------------------
  py::register_exception<nsa_cp::P2PDeviceError>(m, "P2PDeviceError", PyExc_RuntimeError);
  using nsa_cp::P2PConfig;
  py::class_<P2PConfig>(m, "P2PConfig", R"doc(Everything a P2PState is built from, by name (all keyword arguments).

device: CUDA device index the launches go to. rank, world: 0 <= rank < world <= MAX_WORLD.
gather_ptrs: device uint64[2][world], every rank's gather buffer 0 (row 0) and 1 (row 1; row 0's
addresses again without a second buffer). reduce_ptrs: device uint64[world], every rank's reduce
buffer. pads: device uint64[world], every rank's signal pad (SIGNAL_WORDS uint32). seq, arrive:
device uint32[2] (channel 0 gather, 1 reduce-scatter), zeroed. gather_state: device uint32[2], zeroed.
err_host, err_dev: host and device address of the host-mapped uint32[ERR_RECORD_WORDS] error record
(alloc_host_mapped_u32). timeout_ns: wait bound (0 = forever). hidden: elements per row. dtype:
DTYPE_* of the rows. sm_count: SMs of the device (block policy). max_rows_per_rank: rows per rank of
gather buffer 0 and of the reduce buffer (the capacity). double_buffer_rows: rows per rank of gather
buffer 1 (0: none). check_layout: every launch carries a fingerprint of what it assumes (layout
counts, max_rank_len, row bytes, compact / ordered / norm / fp8, epoch) in the signals it exchanges
anyway, and compares every peer's with its own (ERR_LAYOUT_MISMATCH; no extra signal or wait).
Values are checked by P2PState (ValueError); a negative address is a TypeError here.)doc")
      .def(py::init([](int device, int rank, int world, uint64_t gather_ptrs, uint64_t reduce_ptrs, uint64_t pads,
                       uint64_t seq, uint64_t arrive, uint64_t gather_state, uint64_t err_host, uint64_t err_dev,
                       uint64_t timeout_ns, int64_t hidden, int dtype, int sm_count, int64_t max_rows_per_rank,
                       int64_t double_buffer_rows, bool check_layout) {
             return P2PConfig{device,  rank,         world,      gather_ptrs, reduce_ptrs, pads,
                              seq,     arrive,       gather_state, err_host,  err_dev,     timeout_ns,
                              hidden,  dtype,        sm_count,   max_rows_per_rank, double_buffer_rows,
                              check_layout};
           }),
           py::kw_only(), py::arg("device"), py::arg("rank"), py::arg("world"), py::arg("gather_ptrs"),
           py::arg("reduce_ptrs"), py::arg("pads"), py::arg("seq"), py::arg("arrive"), py::arg("gather_state"),
           py::arg("err_host"), py::arg("err_dev"), py::arg("timeout_ns"), py::arg("hidden"), py::arg("dtype"),
           py::arg("sm_count"), py::arg("max_rows_per_rank"), py::arg("double_buffer_rows"),
           py::arg("check_layout") = true)
      .def_readonly("device", &P2PConfig::device)
      .def_readonly("rank", &P2PConfig::rank)
      .def_readonly("world", &P2PConfig::world)
      .def_readonly("hidden", &P2PConfig::hidden)
      .def_readonly("dtype", &P2PConfig::dtype)
      .def_readonly("sm_count", &P2PConfig::sm_count)
      .def_readonly("max_rows_per_rank", &P2PConfig::max_rows_per_rank)
      .def_readonly("double_buffer_rows", &P2PConfig::double_buffer_rows)
      .def_readonly("check_layout", &P2PConfig::check_layout);
  py::class_<nsa_cp::P2PState>(m, "P2PState", R"doc(One rank's P2P transport state, bound once (DeepEP's Buffer idea).

P2PState(config): built once per transport from a P2PConfig (every address and size that stays
fixed), all checked here (ValueError). Its launch methods take only what changes per call, check only
that (ValueError, before any CUDA call), read the host-mapped error record first (P2PDeviceError, a
RuntimeError, when an earlier call failed on the device: nothing is enqueued), make `device` current
for the launch and restore the caller's device after. The GIL is released while they enqueue.

Double buffering: a gather whose max_rank_len fits gather buffer 1 writes the other buffer than the
previous gather did; a larger one writes buffer 0. The gathers return the buffer they wrote.)doc")
      .def(py::init<const P2PConfig&>(), py::arg("config"))
      .def("gather", &nsa_cp::P2PState::gather, py::arg("src"), py::arg("src_row_stride_bytes"), py::arg("counts"),
           py::arg("offsets"), py::arg("max_rank_len"), py::arg("compact"), py::arg("stream"), py::arg("positions") = 0,
           py::arg("num_positions") = -1, py::call_guard<py::gil_scoped_release>(),
           R"doc(Enqueue the all-gather (p2p_gather's kernel) and return the gather buffer written (0 or 1).

src: device address of our rows, row r at src + r*src_row_stride_bytes (each row dense; 0 allowed when
counts[rank] == 0). counts, offsets: device int32[world] (offsets only read when compact). max_rank_len:
M <= max_rows_per_rank. compact: compact or padded geometry. stream: cudaStream_t of `device`.
positions, num_positions: an ordered call (needs compact=True): device int64[num_positions], the same
on every rank; compact row i lands at row positions[i] of the [num_positions] output
(num_positions <= world * M). 0: not ordered.)doc")
      .def("norm_gather", &nsa_cp::P2PState::norm_gather, py::arg("x"), py::arg("x_row_stride_bytes"),
           py::arg("residual"), py::arg("residual_row_stride_bytes"), py::arg("weight"), py::arg("weight_dtype"),
           py::arg("eps"), py::arg("norm"), py::arg("quant"), py::arg("counts"), py::arg("offsets"),
           py::arg("max_rank_len"), py::arg("compact"), py::arg("stream"), py::arg("positions") = 0,
           py::arg("num_positions") = -1, py::call_guard<py::gil_scoped_release>(),
           R"doc(Enqueue the gather with the norm stage and return the gather buffer written (0 or 1).

Per row of x (one block per row): s = x + residual in fp32 (residual=0: s = x); residual <- s rounded
to the dtype, in place; y = s * rsqrt(mean(s^2) + eps) * weight in fp32 (norm=False: y = s), then
quant=0: y rounded once, pushed as a row of the dtype; quant=1 (fp8_e4m3_g128, SGLang's
per_token_group_quant_fp8): y rounded to the dtype, then per group of 128 columns amax (fp32) clamped
>= 1e-10, scale = amax / 448, q = clamp(y / scale, -448, 448) as float8_e4m3fn, pushed into the
buffers' fp8 layout: bytes [0, C*hidden) q [C, hidden], bytes [scale_offset(b), ...) the scales
[C, hidden/128] float32, C = gather_rows(b); padding rows q = 0, scale = 1e-10/448.
x, residual: 16-byte aligned addresses and row strides (each row dense). weight: device [hidden] of
weight_dtype (DTYPE_*; any value when norm=False). Rows of at most 4 * THREADS_PER_BLOCK 16-byte
words. The rest as in gather.)doc")
      .def("reduce_scatter", &nsa_cp::P2PState::reduce_scatter, py::arg("out"), py::arg("out_row_stride_bytes"),
           py::arg("counts"), py::arg("offsets"), py::arg("max_rank_len"), py::arg("compact"), py::arg("stream"),
           py::arg("positions") = 0, py::arg("num_positions") = -1, py::call_guard<py::gil_scoped_release>(),
           R"doc(Enqueue the reduce-scatter (p2p_reduce_scatter's kernel) over the reduce buffers.

out: device address of our [counts[rank], hidden] result, row i at out + i*out_row_stride_bytes.
positions, num_positions: an ordered call (compact=True): every reduce buffer holds [num_positions]
rows in batch order and our row i is summed from row positions[offsets[rank] + i]. The rest as in
gather.)doc")
      .def("reduce_scatter_norm", &nsa_cp::P2PState::reduce_scatter_norm, py::arg("out"),
           py::arg("out_row_stride_bytes"), py::arg("residual"), py::arg("residual_row_stride_bytes"),
           py::arg("weight"), py::arg("weight_dtype"), py::arg("eps"), py::arg("counts"), py::arg("offsets"),
           py::arg("max_rank_len"), py::arg("compact"), py::arg("stream"), py::arg("positions") = 0,
           py::arg("num_positions") = -1, py::call_guard<py::gil_scoped_release>(),
           R"doc(Enqueue the reduce-scatter fused with the next add + RMSNorm (one block per row).

Per row i of ours: h = the sum over ranks (rank order, fp32) rounded to the dtype (what reduce_scatter
writes); s = h + residual[i] in fp32; residual[i] <- s rounded, in place; out[i] = s * rsqrt(mean(s^2)
+ eps) * weight in fp32, rounded once. out, residual: 16-byte aligned addresses and row strides (0
only when this rank has no rows);
weight: device [hidden] of weight_dtype (DTYPE_*). The rest as in reduce_scatter.)doc")
      .def("barrier", &nsa_cp::P2PState::barrier, py::arg("stream"), py::call_guard<py::gil_scoped_release>(),
           "Enqueue a barrier of the group on the gather channel (one 32-thread block).")
      .def("copy_engine_begin", &nsa_cp::P2PState::copy_engine_begin, py::arg("stream"),
           py::call_guard<py::gil_scoped_release>(),
           "The copy-engine gather's entry barrier (the caller's copies into peers' buffer 0 follow).")
      .def("copy_engine_end", &nsa_cp::P2PState::copy_engine_end, py::arg("stream"),
           py::call_guard<py::gil_scoped_release>(),
           "The copy-engine gather's done barrier, then the record that buffer 0 was written last. Runs\n"
           "even when the error record is set (it completes a call already begun).")
      .def("error", &nsa_cp::P2PState::error, "The error record, ERR_RECORD_WORDS values: [code, channel*2 + phase, rank, epoch, then for a\n"
           "layout mismatch own hash, own desc, peer hash, peer desc, peer epoch] (volatile reads).")
      .def_property_readonly("check_layout", &nsa_cp::P2PState::check_layout)
      .def("gather_rows", &nsa_cp::P2PState::gather_rows, py::arg("buffer"), "Capacity rows of gather buffer 0 or 1.")
      .def("scale_offset", &nsa_cp::P2PState::scale_offset, py::arg("buffer"),
           "Byte offset of the fp8 scale block in gather buffer 0 or 1 (gather_rows * hidden rounded up to 16).")
      .def("close", &nsa_cp::P2PState::close,
           "Refuse every later launch and error() (RuntimeError): call it before freeing the error record\n"
           "or the buffers this state points at.")
      .def_property_readonly("closed", &nsa_cp::P2PState::closed)
      .def_property_readonly("last_buffer", &nsa_cp::P2PState::last_buffer)
      .def_property_readonly("rank", &nsa_cp::P2PState::rank)
      .def_property_readonly("world", &nsa_cp::P2PState::world)
      .def_property_readonly("device", &nsa_cp::P2PState::device)
      .def_property_readonly("hidden", &nsa_cp::P2PState::hidden)
      .def_property_readonly("row_bytes", &nsa_cp::P2PState::row_bytes)
      .def_property_readonly("max_rows_per_rank", &nsa_cp::P2PState::max_rows_per_rank)
      .def_property_readonly("double_buffer_rows", &nsa_cp::P2PState::double_buffer_rows);

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
