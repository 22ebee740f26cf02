// pybind11 bindings of nsa_cp._C's P2P transport state (P2PConfig, P2PState, P2PDeviceError), called from
// the module definition in bindings.cpp.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "codes.h"
#include "ops.h"

namespace py = pybind11;

namespace nsa_cp {

void bind_p2p_state(py::module_& m) {
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
quant=QUANT_NONE (0): y rounded once, pushed as a row of the dtype; another QUANT_* code (WIRE_FORMATS
holds each format's traits; QUANT_FP8_E4M3_G128 is SGLang's per_token_group_quant_fp8): y rounded to the
dtype, then per group of `group` columns amax (fp32) clamped >= amax_floor, scale = amax / max (>=
scale_floor; rounded up to a power of two with pow2_scales), q = clamp(y / scale, -max, max) as
float8_e4m3fn, pushed into the buffers' fp8 layout: bytes [0, C*hidden) q [C, hidden], bytes
[scale_offset(b), ...) the scales [C, hidden/group] float32, C = gather_rows(b); padding rows q = 0 and
the scale of a zero group.
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
      .def("pull_begin", &nsa_cp::P2PState::pull_begin, py::arg("stream"), py::arg("fp_hash"), py::arg("fp_desc"),
           py::call_guard<py::gil_scoped_release>(),
           "The overlapped boundary's entry barrier (copy_engine_begin carrying the caller's call fingerprint:\n"
           "uint32 hash and desc, compared with every peer's when check_layout; a mismatch sets the error\n"
           "record, code ERR_LAYOUT_MISMATCH). The caller's copy-engine pulls and pushes follow; copy_engine_end\n"
           "closes the call.")
      .def("poison_on_error", &nsa_cp::P2PState::poison_on_error, py::arg("ptr"), py::arg("bytes"), py::arg("stream"),
           py::call_guard<py::gil_scoped_release>(),
           "Enqueue one kernel that overwrites [ptr, ptr + bytes) with 0xFF bytes (NaN) only when the error\n"
           "record is set as it runs (a result of a call whose barrier failed); runs even when it is set.")
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
}

}  // namespace nsa_cp
