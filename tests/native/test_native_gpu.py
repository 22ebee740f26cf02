"""The kernels of nsa_cp._C on one GPU, with several simulated "ranks" in one process (the protocol,
layouts and arithmetic run for real; peers' pointers are local ones). Skips without a GPU."""

from __future__ import annotations


import pytest

from nsa_cp.rows import _native
from nsa_cp.geometry.wire import FORMATS


_C = _native.load()
needs_C = pytest.mark.skipif(_C is None, reason=f"nsa_cp._C not importable: {_native._import_reason}")
_NO_GPU = _C is not None and _C.device_count() == 0


# ---- on a GPU: several "ranks" of one process on one device ----------------------------------------
#
# Each simulated rank has its own pad, seq, arrive, buffers and stream, exactly as separate processes
# would (peers' pointers are just local ones here), so the protocol, the layouts and the arithmetic
# run for real on one GPU. Every wait has a timeout: a protocol bug fails the test instead of hanging.

needs_gpu = pytest.mark.skipif(
    _C is None or _NO_GPU or not __import__("torch").cuda.is_available(), reason="needs nsa_cp._C and a CUDA device"
)
TIMEOUT_NS = 5_000_000_000
CHANNELS = 2


class _Ranks:
    def __init__(self, world, capacity_rows, hidden, dtype, num_blocks=8):
        import torch

        dev = torch.device("cuda")
        self.torch, self.world, self.hidden, self.dtype, self.num_blocks = torch, world, hidden, dtype, num_blocks
        self.pads = [torch.zeros(_C.SIGNAL_WORDS, dtype=torch.int32, device=dev) for _ in range(world)]
        self.pad_ptrs = torch.tensor([p.data_ptr() for p in self.pads], dtype=torch.int64, device=dev)
        # garbage, so unwritten rows and un-zeroed padding show up
        self.bufs = [torch.full((capacity_rows, hidden), 7, dtype=dtype, device=dev) for _ in range(world)]
        self.buf_ptrs = torch.tensor([b.data_ptr() for b in self.bufs], dtype=torch.int64, device=dev)
        self.seq = [torch.zeros(CHANNELS, dtype=torch.int32, device=dev) for _ in range(world)]
        self.arrive = [torch.zeros(CHANNELS, dtype=torch.int32, device=dev) for _ in range(world)]
        self.state = [torch.zeros(CHANNELS, 2, dtype=torch.int32, device=dev) for _ in range(world)]  # gather state
        self.err = [_C.alloc_host_mapped_u32(4) for _ in range(world)]
        self.streams = [torch.cuda.Stream() for _ in range(world)]
        torch.cuda.synchronize()

    def close(self):
        for host, _ in self.err:
            _C.free_host_mapped(host)

    def sig(self, r, channel):
        return dict(
            rank=r, world=self.world, pads=self.pad_ptrs.data_ptr(), channel=channel,
            seq=self.seq[r].data_ptr() + 4 * channel, arrive=self.arrive[r].data_ptr() + 4 * channel,
            timeout_ns=TIMEOUT_NS, err=self.err[r][1],
        )

    def gather_state(self, r, channel=0):
        return self.state[r][channel].data_ptr()

    def errors(self):
        return [[_C.read_u32(host, i) for i in range(4)] for host, _ in self.err]

    @staticmethod
    def layout(counts, compact):
        import torch

        offsets = [sum(counts[:q]) for q in range(len(counts))]
        dc = torch.tensor(counts, dtype=torch.int32, device="cuda")
        do = torch.tensor(offsets, dtype=torch.int32, device="cuda")
        return offsets, dc, do

    def gather(self, shards, counts, M, compact, channel=0, ranks=None):
        torch = self.torch
        _, dc, do = self.layout(counts, compact)
        torch.cuda.synchronize()
        for r in ranks if ranks is not None else range(self.world):
            x = shards[r]
            with torch.cuda.stream(self.streams[r]):
                _C.p2p_gather(
                    src=x.data_ptr(), src_row_stride_bytes=x.stride(0) * x.element_size(),
                    row_bytes=self.hidden * x.element_size(), bufs=self.buf_ptrs.data_ptr(), counts=dc.data_ptr(),
                    offsets=do.data_ptr(), max_rank_len=M, compact=compact, num_blocks=self.num_blocks,
                    stream=self.streams[r].cuda_stream, buffer=0, state=self.gather_state(r, channel),
                    **self.sig(r, channel),
                )
        torch.cuda.synchronize()

    def reduce_scatter(self, outs, counts, M, compact, dtype_code, channel=1):
        torch = self.torch
        _, dc, do = self.layout(counts, compact)
        torch.cuda.synchronize()
        for r in range(self.world):
            with torch.cuda.stream(self.streams[r]):
                _C.p2p_reduce_scatter(
                    out=outs[r].data_ptr(), out_row_stride_bytes=outs[r].stride(0) * outs[r].element_size(),
                    bufs=self.buf_ptrs.data_ptr(), counts=dc.data_ptr(), offsets=do.data_ptr(), max_rank_len=M,
                    compact=compact, hidden=self.hidden, dtype=dtype_code, num_blocks=self.num_blocks,
                    stream=self.streams[r].cuda_stream, **self.sig(r, channel),
                )
        torch.cuda.synchronize()


def _expected_gather(shards, counts, M, compact, hidden, dtype):
    import torch

    if compact:
        return torch.cat([s[:n] for s, n in zip(shards, counts)])
    out = torch.zeros(len(counts) * M, hidden, dtype=dtype, device="cuda")
    for q, (s, n) in enumerate(zip(shards, counts)):
        out[q * M : q * M + n] = s[:n]
    return out


@needs_gpu
def test_gpu_kernel_info():
    info = _C.kernel_info()
    names = {k["name"] for k in info}
    families = ("barrier", "poison_on_error", "p2p_gather", "p2p_reduce_scatter", "pack_rows", "padded_compact")
    assert {n.split("<")[0] for n in names} == set(families), names
    # copy / fused norm / fp8 stages of the gather, plain and norm-epilogue reduce-scatters, row copies
    assert len(info) == 2 + (3 + 3 * 2 * 3) + 12 + 6, sorted(names)  # barrier, poison; gather: copy x3, dtype x words x format
    assert {"p2p_gather<copy16>", "p2p_gather<norm,bf16,2>", "p2p_gather<fp8_e4m3_g128,bf16,2>", "p2p_gather<fp8_e4m3_g128_ue8m0,bf16,4>",
            "p2p_reduce_scatter<norm,bf16,2>"} <= names
    import torch

    assert _native.device_support(torch.cuda.current_device()), "this GPU runs them"
    for k in info:
        assert k["local_bytes"] == 0, k  # no spills / stack
        assert k["binary_version"] >= 90, k
    print(info)


@needs_gpu
@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize("hidden, dtype_name", [(256, "bfloat16"), (9, "bfloat16"), (6, "float32"), (33, "float16")])
def test_gpu_p2p_gather(world, compact, hidden, dtype_name):
    import torch

    dtype = getattr(torch, dtype_name)
    M = 37
    ranks = _Ranks(world, world * M, hidden, dtype)
    try:
        gen = torch.Generator(device="cuda").manual_seed(world)
        # an odd number of calls with changing counts (0 and M included): epochs, stale rows, padding
        rounds = [[M - q for q in range(world)], [(7 * q) % (M + 1) for q in range(world)], [M] * world]
        rounds[1][0] = 0
        for counts in rounds:
            shards = [torch.randn(M, hidden, generator=gen, device="cuda").to(dtype) for _ in range(world)]
            if world > 1:  # a strided source
                wide = torch.randn(M, hidden + 8, generator=gen, device="cuda").to(dtype)
                shards[1] = wide[:, :hidden]
            for b in ranks.bufs:  # unwritten rows and un-zeroed padding must show
                b.fill_(float("nan"))
            ranks.gather(shards, counts, M, compact)
            assert ranks.errors() == [[0, 0, 0, 0]] * world
            expected = _expected_gather(shards, counts, M, compact, hidden, dtype)
            for r in range(world):
                got = ranks.bufs[r][: expected.shape[0]]
                assert torch.equal(got, expected), (r, counts)
        assert all(int(s[0]) == len(rounds) for s in ranks.seq)
        assert all(int(a[0]) == 0 for a in ranks.arrive)
    finally:
        ranks.close()


@needs_gpu
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("compact", [False, True])
@pytest.mark.parametrize(
    "hidden, dtype_name, code",
    [(512, "bfloat16", 0), (512, "float16", 1), (128, "float32", 2), (7, "bfloat16", 0), (5, "float32", 2)],
)
def test_gpu_p2p_reduce_scatter(world, compact, hidden, dtype_name, code):
    import torch

    dtype = getattr(torch, dtype_name)
    M = 29
    ranks = _Ranks(world, world * M, hidden, dtype)
    try:
        gen = torch.Generator(device="cuda").manual_seed(100 + world)
        for counts in ([M - 3 * q for q in range(world)], [M] * world, [0] + [M // 2] * (world - 1)):
            total = sum(counts) if compact else world * M
            for b in ranks.bufs:
                b[:total] = torch.randn(total, hidden, generator=gen, device="cuda").to(dtype)
            outs = [torch.full((counts[r], hidden), 3, dtype=dtype, device="cuda") for r in range(world)]
            ranks.reduce_scatter(outs, counts, M, compact, code)
            assert ranks.errors() == [[0, 0, 0, 0]] * world
            for r in range(world):
                start = sum(counts[:r]) if compact else r * M
                rows = slice(start, start + counts[r])
                acc = ranks.bufs[0][rows].float()
                for p in range(1, world):
                    acc = acc + ranks.bufs[p][rows].float()  # fixed order, fp32
                assert torch.equal(outs[r], acc.to(dtype)), (r, counts)
    finally:
        ranks.close()


@needs_gpu
def test_gpu_barrier_and_timeout_record():
    import torch

    ranks = _Ranks(2, 4, 16, torch.bfloat16)
    try:
        # both ranks: phase 0 (no advance), phase 1 (advance) -> seq 1
        for phase, advance in ((0, False), (1, True)):
            for r in range(2):
                with torch.cuda.stream(ranks.streams[r]):
                    kw = ranks.sig(r, 0)
                    kw.pop("arrive")
                    _C.barrier(phase=phase, advance=advance, stream=ranks.streams[r].cuda_stream, **kw)
            torch.cuda.synchronize()
        assert [int(s[0]) for s in ranks.seq] == [1, 1]
        assert ranks.errors() == [[0, 0, 0, 0]] * 2

        # rank 0 alone on channel 1: times out waiting for rank 1, records it, and returns
        kw = ranks.sig(0, 1)
        kw.pop("arrive")
        kw["timeout_ns"] = 2_000_000
        _C.barrier(phase=0, advance=True, stream=0, **kw)
        torch.cuda.synchronize()
        assert ranks.errors()[0] == [_C.ERR_TIMEOUT, 1 * 2 + 0, 1, 1]
        _C.write_u32(ranks.err[0][0], 0, 0)

        # the same through p2p_gather: the entry wait times out, the launch still completes and
        # leaves arrive reset and seq advanced
        shards = [torch.ones(4, 16, dtype=torch.bfloat16, device="cuda")] * 2
        kw = ranks.sig(0, 0)
        kw["timeout_ns"] = 2_000_000
        def gather_rank0(counts):
            _C.p2p_gather(src=shards[0].data_ptr(), src_row_stride_bytes=32, row_bytes=32,
                          bufs=ranks.buf_ptrs.data_ptr(), counts=counts.data_ptr(), offsets=0, max_rank_len=4,
                          compact=False, num_blocks=8, stream=0, buffer=0, state=ranks.gather_state(0), **kw)
            torch.cuda.synchronize()

        gather_rank0(torch.tensor([4, 4], dtype=torch.int32, device="cuda"))
        assert ranks.errors()[0] == [_C.ERR_TIMEOUT, 0, 1, 2]
        assert int(ranks.seq[0][0]) == 2 and int(ranks.arrive[0][0]) == 0
        _C.write_u32(ranks.err[0][0], 0, 0)

        # device-side counts out of range: recorded, nothing moved, nobody waits
        gather_rank0(torch.tensor([5, 4], dtype=torch.int32, device="cuda"))
        assert ranks.errors()[0] == [_C.ERR_BAD_DEVICE_ARG, 0, 0, 3]
    finally:
        ranks.close()


@needs_gpu
def test_gpu_double_buffer_entry_wait():
    """The entry wait is skipped exactly when the previous gather wrote the other buffer. Rank 0 calls
    alone, so the phase that times out (in the error record) shows whether it waited at entry; then both
    ranks alternate buffers, and results and the recorded tags are checked."""
    import torch

    world, M, hidden, dtype = 2, 8, 16, torch.bfloat16
    ranks = _Ranks(world, world * M, hidden, dtype)
    try:
        alt = [torch.full((world * M, hidden), 7, dtype=dtype, device="cuda") for _ in range(world)]
        ptrs = [ranks.buf_ptrs, torch.tensor([b.data_ptr() for b in alt], dtype=torch.int64, device="cuda")]
        bufs = [ranks.bufs, alt]
        dc = torch.tensor([M, M - 3], dtype=torch.int32, device="cuda")

        def call(r, shard, buffer, timeout_ns=TIMEOUT_NS):
            kw = ranks.sig(r, 0)
            kw["timeout_ns"] = timeout_ns
            with torch.cuda.stream(ranks.streams[r]):
                _C.p2p_gather(src=shard.data_ptr(), src_row_stride_bytes=hidden * 2, row_bytes=hidden * 2,
                              bufs=ptrs[buffer].data_ptr(), counts=dc.data_ptr(), offsets=0, max_rank_len=M,
                              compact=False, num_blocks=4 + r, stream=ranks.streams[r].cuda_stream, buffer=buffer,
                              state=ranks.gather_state(r), **kw)

        shard = torch.randn(M, hidden, device="cuda").to(dtype)
        # last 0, buffer 1: no entry wait, so the done barrier is what times out (slot 0*2 + 1), epoch 1
        call(0, shard, 1, timeout_ns=2_000_000)
        torch.cuda.synchronize()
        assert ranks.errors()[0] == [_C.ERR_TIMEOUT, 1, 1, 1]
        assert int(ranks.state[0][0, 0]) == 1
        for i in range(4):
            _C.write_u32(ranks.err[0][0], i, 0)
        # last 1, buffer 1: the entry wait (slot 0) times out first, epoch 2
        call(0, shard, 1, timeout_ns=2_000_000)
        torch.cuda.synchronize()
        assert ranks.errors()[0] == [_C.ERR_TIMEOUT, 0, 1, 2]
        for i in range(4):
            _C.write_u32(ranks.err[0][0], i, 0)

        # both ranks in step again (rank 1 catches up to epoch 2), then alternate 0, 1, 0, 1, 1
        for t in ranks.pads + ranks.seq + ranks.state:  # the pads hold rank 0's signals of epochs 1 and 2
            t.zero_()
        for buffer in (0, 1, 0, 1, 1):
            shards = [torch.randn(M, hidden, device="cuda").to(dtype) for _ in range(world)]
            torch.cuda.synchronize()
            for r in range(world):
                call(r, shards[r], buffer)
            torch.cuda.synchronize()
            assert ranks.errors() == [[0, 0, 0, 0]] * world
            expected = _expected_gather(shards, [M, M - 3], M, False, hidden, dtype)
            for r in range(world):
                assert torch.equal(bufs[buffer][r], expected), (r, buffer)
                assert int(ranks.state[r][0, 0]) == buffer
        # every launch added DONE_QUANTUM to every rank's counter, whatever its grid (4 and 5 blocks)
        for r in range(world):
            counters = ranks.pads[r][_C.DONE_BASE : _C.DONE_BASE + world].tolist()
            assert counters == [5 * _C.DONE_QUANTUM] * world and int(ranks.state[r][0, 1]) == 5 * _C.DONE_QUANTUM
    finally:
        ranks.close()


@needs_gpu
def test_gpu_graph_replay_with_new_counts():
    """Each rank's gather captured once; replays (an odd number) read new counts from device memory."""
    import torch

    world, M, hidden, dtype = 2, 16, 64, torch.bfloat16
    ranks = _Ranks(world, world * M, hidden, dtype)
    try:
        counts_dev = torch.tensor([M, M], dtype=torch.int32, device="cuda")
        offsets_dev = torch.zeros(world, dtype=torch.int32, device="cuda")
        shards = [torch.randn(M, hidden, device="cuda").to(dtype) for _ in range(world)]
        _C.kernel_info()  # load the module before capture
        graphs = []
        for r in range(world):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, stream=ranks.streams[r]):
                _C.p2p_gather(
                    src=shards[r].data_ptr(), src_row_stride_bytes=hidden * 2, row_bytes=hidden * 2,
                    bufs=ranks.buf_ptrs.data_ptr(), counts=counts_dev.data_ptr(), offsets=offsets_dev.data_ptr(),
                    max_rank_len=M, compact=False, num_blocks=4, stream=ranks.streams[r].cuda_stream,
                    buffer=0, state=ranks.gather_state(r), **ranks.sig(r, 0),
                )
            graphs.append(g)
        for counts in ([3, 16], [16, 0], [9, 11]):
            counts_dev.copy_(torch.tensor(counts, dtype=torch.int32))
            torch.cuda.synchronize()
            for r in range(world):
                with torch.cuda.stream(ranks.streams[r]):
                    graphs[r].replay()
            torch.cuda.synchronize()
            assert ranks.errors() == [[0, 0, 0, 0]] * world
            expected = _expected_gather(shards, counts, M, False, hidden, dtype)
            for r in range(world):
                assert torch.equal(ranks.bufs[r], expected), (r, counts)
        assert [int(s[0]) for s in ranks.seq] == [3, 3]  # capture itself ran nothing
    finally:
        ranks.close()


# ---- P2PState: simulated ranks of one process, each with its own native state ------------------------


class _States:
    """``world`` P2PStates over buffers of one GPU (peers' addresses are local ones), each launching on its
    own stream; few blocks (sm_count=4) so every simulated rank's kernel is resident at once."""

    def __init__(self, world, max_rows, double_rows, hidden, dtype):
        import torch

        dev = torch.device("cuda")
        self.torch, self.world, self.hidden, self.dtype, self.max_rows = torch, world, hidden, dtype, max_rows
        self.pads = [torch.zeros(_C.SIGNAL_WORDS, dtype=torch.int32, device=dev) for _ in range(world)]
        self.gathers = [[torch.full((world * rows, hidden), 7, dtype=dtype, device=dev) for _ in range(world)]
                        for rows in (max_rows, double_rows)]
        self.reduces = [torch.full((world * max_rows, hidden), 7, dtype=dtype, device=dev) for _ in range(world)]
        self.gather_ptrs = torch.tensor([[t.data_ptr() for t in bufs] for bufs in self.gathers], dtype=torch.int64,
                                        device=dev)
        self.reduce_ptrs = torch.tensor([t.data_ptr() for t in self.reduces], dtype=torch.int64, device=dev)
        self.pad_ptrs = torch.tensor([p.data_ptr() for p in self.pads], dtype=torch.int64, device=dev)
        self.local = [torch.zeros(6, dtype=torch.int32, device=dev) for _ in range(world)]  # seq[2] arrive[2] state[2]
        self.err = [_C.alloc_host_mapped_u32(_C.ERR_RECORD_WORDS) for _ in range(world)]
        self.streams = [torch.cuda.Stream() for _ in range(world)]
        code = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}[dtype]
        self.states = [
            _C.P2PState(_C.P2PConfig(
                device=torch.cuda.current_device(), rank=r, world=world, gather_ptrs=self.gather_ptrs.data_ptr(),
                reduce_ptrs=self.reduce_ptrs.data_ptr(), pads=self.pad_ptrs.data_ptr(), seq=self.local[r].data_ptr(),
                arrive=self.local[r].data_ptr() + 8, gather_state=self.local[r].data_ptr() + 16,
                err_host=self.err[r][0], err_dev=self.err[r][1], timeout_ns=TIMEOUT_NS, hidden=hidden, dtype=code,
                sm_count=4, max_rows_per_rank=max_rows, double_buffer_rows=double_rows))
            for r in range(world)
        ]
        torch.cuda.synchronize()

    def close(self):
        for s in self.states:
            s.close()
        for host, _ in self.err:
            _C.free_host_mapped(host)

    def each(self, call):
        """``call(rank, state, stream_int)`` for every rank on its own stream; returns the results, after
        checking that no error record is set."""
        out = _launch_all(self, call)
        assert [s.error()[0] for s in self.states] == [0] * self.world, [s.error() for s in self.states]
        return out

    def view(self, buffer, rank, rows):
        return self.gathers[buffer][rank][:rows]


@needs_gpu
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_gpu_p2p_state_gathers(dtype_name):
    """P2PState on one GPU: plain, fused norm, fp8 and ordered gathers, the reduce-scatter with and
    without its norm epilogue, against torch references; the double buffer alternates for layouts that fit
    the second buffer, buffer 0 otherwise."""
    import torch

    from nsa_cp.rows import reference

    dtype = getattr(torch, dtype_name)
    world, max_rows, double_rows, hidden = 2, 16, 8, 256
    st = _States(world, max_rows, double_rows, hidden, dtype)
    try:
        g = torch.Generator().manual_seed(5)
        rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype).cuda()  # noqa: E731
        last = [0]

        def next_buffer(m):  # what every P2PState must pick: alternate while the layout fits buffer 1
            last[0] = 1 - last[0] if m <= double_rows else 0
            return last[0]

        for counts in ([5, 3], [0, 8], [16, 2], [8, 8], [0, 0], [3, 16]):
            m = max(counts)
            offsets = [0, counts[0]]
            dc = torch.tensor(counts, dtype=torch.int32, device="cuda")
            do = torch.tensor(offsets, dtype=torch.int32, device="cuda")
            xs = [rand(n, hidden) for n in counts]
            for compact in (False, True):
                rows = sum(counts) if compact else world * m
                got = st.each(lambda r, s, stream: s.gather(xs[r].data_ptr(), xs[r].stride(0) * xs[r].element_size(),
                                                             dc.data_ptr(), do.data_ptr(), m, compact, stream))
                assert got == [next_buffer(m)] * world, (counts, compact, got)
                want = _expected_gather(xs, counts, m, compact, hidden, dtype)
                for r in range(world):
                    assert torch.equal(st.view(got[r], r, rows), want), (counts, compact, r)
                # fused add + RMSNorm
                rs = [rand(n, hidden) for n in counts]
                weight = rand(hidden)
                refs = [reference.fused_add_rmsnorm(x.cpu(), r.cpu().clone(), weight.cpu(), 1e-6) for x, r in zip(xs, rs)]
                got = st.each(lambda r, s, stream: s.norm_gather(
                    xs[r].data_ptr(), xs[r].stride(0) * xs[r].element_size(), rs[r].data_ptr(),
                    rs[r].stride(0) * rs[r].element_size(), weight.data_ptr(), {torch.bfloat16: 0, torch.float32: 2}[dtype],
                    1e-6, True, 0, dc.data_ptr(), do.data_ptr(), m, compact, stream))
                assert got == [next_buffer(m)] * world, (counts, compact, got)
                want = _expected_gather([y.cuda() for y, _ in refs], counts, m, compact, hidden, dtype)
                tol = dict(rtol=2 ** -7, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
                for r in range(world):
                    torch.testing.assert_close(st.view(got[r], r, rows), want, **tol)
                    assert torch.equal(rs[r].cpu(), refs[r][1]), "residual not updated in place"
                # every wire format, quantize only: bitwise against the format's reference quantizer
                for fmt in FORMATS.values():
                    got = st.each(lambda r, s, stream: s.norm_gather(
                        xs[r].data_ptr(), xs[r].stride(0) * xs[r].element_size(), 0, 0, 0, 0, 0.0, False, fmt.code,
                        dc.data_ptr(), do.data_ptr(), m, compact, stream))
                    assert got == [next_buffer(m)] * world, (counts, compact, got)
                    q_want, s_want = fmt.quantize_reference(_expected_gather(xs, counts, m, compact, hidden, dtype).cpu())
                    groups = hidden // fmt.group
                    for r in range(world):
                        raw = st.gathers[got[r]][r].view(-1).view(torch.uint8)
                        q = raw[: rows * hidden].cpu()
                        off = st.states[r].scale_offset(got[r])
                        scale = raw[off: off + rows * groups * 4].view(torch.float32).view(rows, groups).cpu()
                        assert torch.equal(q.view(rows, hidden), q_want.view(torch.uint8)), (fmt, counts, compact, r)
                        assert torch.equal(scale, s_want), (fmt, counts, compact, r)
            # ordered gather (compact geometry): compact row i lands at positions[i]
            total = sum(counts)
            pos = torch.randperm(total, generator=g).cuda()
            got = st.each(lambda r, s, stream: s.gather(xs[r].data_ptr(), xs[r].stride(0) * xs[r].element_size(),
                                                         dc.data_ptr(), do.data_ptr(), m, True, stream,
                                                         pos.data_ptr(), total))
            assert got == [next_buffer(m)] * world, (counts, got)
            want = torch.empty(total, hidden, dtype=dtype, device="cuda")
            if total:
                want[pos] = torch.cat(xs)
            for r in range(world):
                assert torch.equal(st.view(got[r], r, total), want), (counts, r)
            # reduce-scatter, plain and with the norm epilogue (padded)
            partials = [rand(world * m, hidden) for _ in range(world)]
            for r in range(world):
                st.reduces[r][: world * m].copy_(partials[r])
            outs = [torch.full((n, hidden), float("nan"), dtype=dtype, device="cuda") for n in counts]
            st.each(lambda r, s, stream: s.reduce_scatter(outs[r].data_ptr(), hidden * outs[r].element_size(),
                                                          dc.data_ptr(), do.data_ptr(), m, False, stream))
            rs = [rand(n, hidden) for n in counts]
            rs_before = [r.cpu().clone() for r in rs]
            weight = rand(hidden)
            normed = [torch.full((n, hidden), float("nan"), dtype=dtype, device="cuda") for n in counts]
            st.each(lambda r, s, stream: s.reduce_scatter_norm(
                normed[r].data_ptr(), hidden * normed[r].element_size(), rs[r].data_ptr(), hidden * rs[r].element_size(),
                weight.data_ptr(), {torch.bfloat16: 0, torch.float32: 2}[dtype], 1e-6, dc.data_ptr(), do.data_ptr(), m,
                False, stream))
            for r, n in enumerate(counts):
                rows_r = slice(r * m, r * m + n)
                summed = (partials[0][rows_r].float() + partials[1][rows_r].float()).to(dtype)
                assert torch.equal(outs[r], summed), (counts, r)
                y, r_after = reference.fused_add_rmsnorm(summed.cpu(), rs_before[r].clone(), weight.cpu(), 1e-6)
                assert torch.equal(rs[r].cpu(), r_after), ("reduce-scatter norm residual", counts, r)
                torch.testing.assert_close(normed[r].cpu(), y, **tol)
    finally:
        st.close()


def _launch_all(st, call):
    """``call(rank, state, stream_int)`` on every rank's stream, then synchronize; no error check."""
    torch = st.torch
    torch.cuda.synchronize()
    out = []
    for r, state in enumerate(st.states):
        with torch.cuda.stream(st.streams[r]):
            out.append(call(r, state, st.streams[r].cuda_stream))
    torch.cuda.synchronize()
    return out


@needs_gpu
@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("op", ["gather-double-buffered", "gather-entry", "scatter", "agree"])
def test_gpu_p2p_state_fingerprint(world, op):
    """The call fingerprint at worlds 2..8: the last rank's counts differ in rank 0's entry (same
    max_rank_len): every rank records ERR_LAYOUT_MISMATCH naming a disagreeing peer with both fingerprints;
    the double-buffered gather leaves NaN bytes in every rank's result, the gather with an entry wait and
    the reduce-scatter write nothing. Ranks that agree record nothing (op "agree")."""
    import torch

    hidden, max_rows = 256, 16
    st = _States(world, max_rows, 0 if op == "gather-entry" else 8, hidden, torch.bfloat16)
    try:
        good = [4 + q % 3 for q in range(world)]
        bad = list(good)
        bad[0] += 1
        m = max(max(good), max(bad))
        counts = [good if (r != world - 1 or op == "agree") else bad for r in range(world)]
        dc = [torch.tensor(c, dtype=torch.int32, device="cuda") for c in counts]
        do = [torch.tensor([sum(c[:q]) for q in range(world)], dtype=torch.int32, device="cuda") for c in counts]
        xs = [torch.randn(counts[r][r], hidden, device="cuda").bfloat16() for r in range(world)]
        outs = [torch.full((counts[r][r], hidden), float("nan"), dtype=torch.bfloat16, device="cuda") for r in range(world)]
        if op == "scatter":
            _launch_all(st, lambda r, s, stream: s.reduce_scatter(outs[r].data_ptr(), hidden * 2, dc[r].data_ptr(),
                                                                  do[r].data_ptr(), m, True, stream))
        else:
            for b in st.gathers:
                for t in b:
                    t.fill_(float("nan"))
            compact = op == "gather-entry"  # compact: no local zeroing, the buffer stays as poisoned
            got = _launch_all(st, lambda r, s, stream: s.gather(xs[r].data_ptr(), hidden * 2, dc[r].data_ptr(),
                                                                do[r].data_ptr(), m, compact, stream))
        errors = [s.error() for s in st.states]
        if op == "agree":
            assert [e[0] for e in errors] == [0] * world, errors
            return
        for r, e in enumerate(errors):
            assert e[0] == _C.ERR_LAYOUT_MISMATCH, (r, e)
            peer = e[2]
            assert peer != r and (r == world - 1 or peer == world - 1), (r, e)
            assert (e[4], e[5]) != (e[6], e[7]) and e[3] == e[8], (r, e)  # the two fingerprints, one call
            if op == "scatter":
                assert e[1] == 2 and torch.isnan(outs[r].float()).all(), (r, e)
            else:
                rows = sum(counts[r]) if compact else world * m
                view = st.view(got[r], r, rows)
                assert torch.isnan(view.float()).all(), (r, "rows of a disagreeing gather are not NaN")
                assert e[1] == (0 if op == "gather-entry" else 1), (r, e)
    finally:
        st.close()
