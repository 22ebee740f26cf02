"""cp_all_gather / cp_reduce_scatter: check inputs, choose the algorithm, run it.

Design record (what each path does and why):

* Even layout (every rank holds ``max_rank_len`` rows): exactly one ``all_gather_into_tensor`` /
  ``reduce_scatter_tensor`` on the caller's tensors, nothing else, so results are bitwise those of the
  plain even path.
* Padded gather, uneven: one Triton kernel writes ``x`` into this rank's slot of the output and zeroes
  the rest of the slot, then an in-place all-gather on that slot. No ``F.pad``, no temporary.
* Padded reduce-scatter, uneven: ``reduce_scatter_tensor`` into an ``[M, ...]`` buffer and a view of its
  first ``n_r`` rows is returned (no copy; with ``out=`` the rows are copied there).
* Compact layouts, two algorithms (``algo=`` or NSA_CP_COMPACT_ALGO):
  - "padded": the padded collective on a workspace plus one Triton kernel that compacts (gather) or
    expands (reduce-scatter). Costs one extra pass over HBM; best when latency dominates.
  - "coalesced": torch's uneven-list collectives, which NCCL runs as grouped broadcasts / reduces
    writing straight into views of the compact buffer (vLLM's all_gatherv / reduce_scatterv). Moves only
    real rows and needs no extra pass; best when bandwidth dominates. NCCL only (gloo lacks it).
  "auto" takes "coalesced" when a rank slot holds at least NSA_CP_COALESCED_GATHER_MIN_BYTES (16 MiB)
  for gathers, NSA_CP_COALESCED_SCATTER_MIN_BYTES (0) for reduce-scatters, as measured on 2x H200
  (benchmarks/results/): for small gathers the grouped broadcasts cost more than the extra pass; the
  grouped reduces won at every size.
* CPU tensors take the same collectives over gloo with the pure-torch packing of ``reference``.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import envs, reference, validation
from .layout import ShardLayout
from .transport import nccl, p2p

__all__ = ["cp_all_gather", "cp_reduce_scatter"]

_ALGOS = ("auto", "padded", "coalesced")
# A reduce-scatter sums: floating dtypes that NCCL and gloo both add. A gather only moves bytes: fp8 is
# carried as uint8 (same bits), so every dtype either transport carries is accepted.
_SUM_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n))
_GATHER_DTYPES = _SUM_DTYPES + _FP8_DTYPES + (torch.uint8, torch.int8, torch.int32, torch.int64)


# --------------------------------------------------------------------------- input checks
def _shape_str(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def _check_layout(layout, group_size: int) -> None:
    if not isinstance(layout, ShardLayout):
        raise ValueError(f"layout: expected an nsa_cp.ShardLayout, got {type(layout).__name__}")
    if layout.cp_size != group_size:
        raise ValueError(
            f"layout: expected cp_size == group size {group_size}, got cp_size {layout.cp_size} "
            f"({layout!r})"
        )


def _check_input(name: str, t, expected_rows: int, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dim() < 2:
        raise ValueError(f"{name}: expected a tensor of 2 or more dims [{what}, ...], got shape {_shape_str(t.shape)}")
    if t.shape[0] != expected_rows:
        raise ValueError(
            f"{name}: expected shape {_shape_str((expected_rows, *t.shape[1:]))} ({what}), "
            f"got {_shape_str(t.shape)}"
        )


def _check_dtype(name: str, t: torch.Tensor, allowed) -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        raise ValueError(f"{name}: expected dtype one of [{names}], got {t.dtype}")


def _check_out(out: Optional[torch.Tensor], expected_shape, like: torch.Tensor) -> None:
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise ValueError(f"out: expected a torch.Tensor or None, got {type(out).__name__}")
    if tuple(out.shape) != tuple(expected_shape):
        raise ValueError(f"out: expected shape {_shape_str(expected_shape)}, got {_shape_str(out.shape)}")
    if out.dtype != like.dtype:
        raise ValueError(f"out: expected dtype {like.dtype} (the input's), got {out.dtype}")
    if out.device != like.device:
        raise ValueError(f"out: expected device {like.device} (the input's), got {out.device}")
    if not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous tensor of shape {_shape_str(expected_shape)}, got strides {tuple(out.stride())}")


def _check_device_counts(device_counts, layout: ShardLayout, like: torch.Tensor, compact: bool) -> None:
    if device_counts is None:
        return
    if compact:
        raise ValueError("device_counts: supported for the padded layout only (compact shapes depend on the counts), got compact=True")
    if not isinstance(device_counts, (tuple, list)) or len(device_counts) != 2:
        raise ValueError(f"device_counts: expected a (counts, offsets) pair of tensors, got {type(device_counts).__name__}")
    for name, t in zip(("device_counts[0]", "device_counts[1]"), device_counts):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or tuple(t.shape) != (layout.cp_size,) or t.device != like.device:
            got = f"{t.dtype} {_shape_str(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected int32 [{layout.cp_size}] on {like.device}, got {got}")


def _resolve_algo(algo: str, on_cuda: bool, slot_bytes: int, coalesced_min_bytes: int) -> str:
    if algo == "auto":
        algo = envs.NSA_CP_COMPACT_ALGO
    if not on_cuda:
        return "padded"  # gloo has no uneven-list collectives
    if algo == "auto":
        algo = "coalesced" if slot_bytes >= coalesced_min_bytes else "padded"
    return algo


def _row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


_BACKENDS = ("auto", "nccl", "p2p")


def select_p2p_transport(backend: str, group, name: str, t: torch.Tensor, layout: ShardLayout):
    """The P2P transport this call uses, or None for NCCL/gloo. Same answer on every rank."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = envs.NSA_CP_BACKEND
    if backend == "nccl" or (backend == "auto" and (not t.is_cuda or not p2p.any_registered())):
        return None  # the hot path of every NCCL call: keep it to a few attribute reads
    transport = p2p.get_p2p(group)
    if backend == "p2p":
        if transport is None:
            raise ValueError("backend: 'p2p' needs nsa_cp.init_p2p(group, max_tokens_per_rank, hidden_size, dtype) first")
        transport.check_fits(name, t, layout)
        return transport
    # auto: the even layout keeps the plain NCCL collective (the contract); P2P when it fits
    if transport is None or layout.is_even or not transport.fits(t, layout):
        return None
    return transport


# --------------------------------------------------------------------------- data movement
def _pack(x: torch.Tensor, slot: torch.Tensor, count: torch.Tensor) -> None:
    """slot[:n] = x[:n], slot[n:] = 0 with n = count (a device scalar, read on device for CUDA)."""
    if x.is_cuda:
        from .kernels import pack

        pack.pack_into_slot(x, slot, count)
    else:
        reference.pack_into_slot(x[: int(count)], slot)


def _padded_to_compact(padded, layout, compact) -> None:
    if padded.is_cuda:
        from .kernels import compact as kernels

        kernels.padded_to_compact(padded, layout, compact)
    else:
        reference.padded_to_compact(padded, layout, compact)


def _compact_to_padded(compact, layout, padded) -> None:
    if compact.is_cuda:
        from .kernels import compact as kernels

        kernels.compact_to_padded(compact, layout, padded)
    else:
        reference.compact_to_padded(compact, layout, padded)


def _gather_padded(x: torch.Tensor, layout: ShardLayout, rank: int, out: torch.Tensor, group, device_counts) -> None:
    m = layout.max_rank_len
    slot = out[rank * m : (rank + 1) * m]
    counts = layout.device_tensors(x.device)[0] if device_counts is None else device_counts[0]
    _pack(x, slot, counts[rank])
    nccl.all_gather_equal(out, slot, group)


# --------------------------------------------------------------------------- public API
def _comm_device(group, t) -> torch.device:
    if isinstance(t, torch.Tensor):
        return t.device
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _checked(call: str, validate: Optional[bool], layout, group, t, checks):
    """Run ``checks(rank, size)`` (raises ValueError on bad input; returns a plan whose last item
    formats the call's signature, called only here); with validation, agree first.

    With validation every rank takes part in one small all-reduce whatever its own checks said, so a
    rank with bad input or another layout makes every rank raise instead of leaving them in a
    collective (see nsa_cp.validation).
    """
    rank, size = nccl.group_rank_and_size(group)
    if validate is None:
        validate = envs.NSA_CP_VALIDATE
    if not validate:
        return rank, size, checks(rank, size)
    try:
        plan, error = checks(rank, size), None
    except ValueError as err:
        plan, error = None, err
    valid_layout = layout if isinstance(layout, ShardLayout) else None
    signature = plan[-1]() if plan is not None else ""  # formatted only when it is compared
    validation.agree(call, valid_layout, group, rank, size, _comm_device(group, t), error, signature)
    return rank, size, plan


def _signature(t: torch.Tensor, compact: bool, algo, transport, device_counts) -> str:
    """Everything besides the layout that every rank must agree on for the collectives to match."""
    return (
        f"compact={compact}|dtype={t.dtype}|row={tuple(t.shape[1:])}|algo={algo}|"
        f"p2p={transport is not None}|device_counts={device_counts is not None}"
    )


def _check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")


def cp_all_gather(
    x: torch.Tensor,
    layout: ShardLayout,
    group: Optional[dist.ProcessGroup] = None,
    *,
    compact: bool = False,
    out: Optional[torch.Tensor] = None,
    algo: str = "auto",
    backend: str = "auto",
    validate: Optional[bool] = None,
    device_counts: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Gather every rank's shard.

    Args:
        x: this rank's shard ``[n_r, ...]`` (``n_r = layout.per_rank_actual_token[rank]``).
        layout: the group's ShardLayout (the same on every rank).
        group: process group (None: the default group); NCCL for CUDA tensors, gloo for CPU.
        compact: False: padded ``[max_rank_len * cp_size, ...]`` with zero padding rows;
            True: compact ``[total_len, ...]``.
        out: optional contiguous output of exactly that shape, dtype and device.
        algo: compact only, NCCL only: "auto", "padded" or "coalesced" (see module docstring).
        backend: "auto" (P2P for uneven layouts when ``nsa_cp.init_p2p`` registered a transport that
            fits, else NCCL/gloo; NSA_CP_BACKEND overrides), "nccl" or "p2p".
        validate: check with one small all-reduce that every rank passed the same layout and valid
            input, raising on every rank otherwise (None: NSA_CP_VALIDATE, default off).
        device_counts: ``(counts, offsets)``, int32 ``[cp_size]`` tensors on x's device, for CUDA graphs
            captured once per bucket: ``layout`` is then the bucket (its ``max_rank_len`` fixed, ``x``
            has this rank's bucket rows) and the real per-rank counts are read from ``counts`` on the
            device at run time (update them before a replay; each <= max_rank_len). Padded layout only;
            rows of ``x`` past the real count are ignored and the padding is zeroed accordingly.

    Returns:
        The gathered tensor (``out`` when given). On the P2P backend without ``out`` it is a view of
        the transport's gather buffer, valid until the next gather on that group.

    Raises:
        ValueError (LayoutMismatchError with validation) on bad input; nothing is written to ``out``.
    """
    if torch.compiler.is_compiling():  # traced: one nsa_cp::cp_all_gather node (nsa_cp/ops.py)
        from . import ops

        return ops.all_gather(x, layout, group, compact=compact, out=out, algo=algo, backend=backend, validate=validate,
                              device_counts=device_counts)

    def checks(rank, size):
        _check_layout(layout, size)
        _check_input("x", x, layout.count(rank), f"this rank's per_rank_actual_token[{rank}] rows")
        _check_dtype("x", x, _GATHER_DTYPES)
        out_shape = (layout.global_len(compact), *x.shape[1:])
        _check_out(out, out_shape, x)
        _check_choice("algo", algo, _ALGOS)
        chosen = None
        if compact:
            slot_bytes = layout.max_rank_len * _row_bytes(x)
            chosen = _resolve_algo(algo, x.is_cuda, slot_bytes, envs.NSA_CP_COALESCED_GATHER_MIN_BYTES)
        _check_device_counts(device_counts, layout, x, compact)
        transport = select_p2p_transport(backend, group, "x", x, layout)
        return out_shape, chosen, transport, lambda: _signature(x, compact, chosen, transport, device_counts)

    rank, size, (out_shape, algo, transport, _) = _checked("cp_all_gather", validate, layout, group, x, checks)
    if x.dtype in _FP8_DTYPES:  # a gather moves bits: carry fp8 as uint8, which every transport has
        as_bytes = None if out is None else out.view(torch.uint8)
        result = _all_gather(x.view(torch.uint8), layout, group, rank, size, compact, as_bytes, out_shape, algo,
                             transport, device_counts)
        return result.view(x.dtype)
    return _all_gather(x, layout, group, rank, size, compact, out, out_shape, algo, transport, device_counts)


def _all_gather(x, layout, group, rank, size, compact, out, out_shape, algo, transport, device_counts):
    if transport is not None and layout.total_len:
        result = transport.all_gather(x, layout, compact=compact, device_counts=device_counts)
        if out is None:
            return result
        out.copy_(result)
        return out
    if out is None:
        out = x.new_empty(out_shape)
    if layout.total_len == 0:
        return out  # every rank holds nothing; every rank agrees, so nobody communicates
    if layout.is_even and device_counts is None:
        nccl.all_gather_equal(out, x.contiguous(), group)
    elif not compact:
        _gather_padded(x, layout, rank, out, group, device_counts)
    elif algo == "coalesced":
        views = [out[start:stop] for start, stop in (layout.rows(q, compact=True) for q in range(size))]
        nccl.all_gather_uneven(views, x.contiguous(), group)
    else:
        workspace = x.new_empty((layout.padded_len, *x.shape[1:]))
        _gather_padded(x, layout, rank, workspace, group, None)
        _padded_to_compact(workspace, layout, out)
    return out


def cp_reduce_scatter(
    y: torch.Tensor,
    layout: ShardLayout,
    group: Optional[dist.ProcessGroup] = None,
    *,
    compact: bool = False,
    out: Optional[torch.Tensor] = None,
    algo: str = "auto",
    backend: str = "auto",
    validate: Optional[bool] = None,
    device_counts: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> torch.Tensor:
    """Sum every rank's ``y`` and return this rank's rows ``[n_r, ...]``.

    Args:
        y: this rank's partials over all tokens: padded ``[max_rank_len * cp_size, ...]`` (values in
            padding rows are ignored) or compact ``[total_len, ...]``.
        layout, group, compact, algo, backend, validate, device_counts: as for ``cp_all_gather`` (with
            device_counts, rows of the result past this rank's real count are meaningless). On the P2P backend,
            pass the transport's ``reduce_buffer(layout, compact)`` (the MoE writes its partials there)
            to avoid a copy in; the sum is in fp32, in rank order.
        out: optional contiguous ``[n_r, ...]`` output.

    Returns:
        ``[n_r, ...]``. Without ``out`` on an uneven padded layout this is a view of the first ``n_r``
        rows of an ``[max_rank_len, ...]`` buffer (no copy).
    """
    if torch.compiler.is_compiling():  # traced: one nsa_cp::cp_reduce_scatter node (nsa_cp/ops.py)
        from . import ops

        return ops.reduce_scatter(y, layout, group, compact=compact, out=out, algo=algo, backend=backend,
                                  validate=validate, device_counts=device_counts)

    def checks(rank, size):
        _check_layout(layout, size)
        layout_name = "compact [total_len" if compact else "padded [max_rank_len * cp_size"
        _check_input("y", y, layout.global_len(compact), f"the {layout_name}, ...] layout")
        _check_dtype("y", y, _SUM_DTYPES)
        out_shape = (layout.count(rank), *y.shape[1:])
        _check_out(out, out_shape, y)
        _check_choice("algo", algo, _ALGOS)
        chosen = None
        if compact:
            slot_bytes = layout.max_rank_len * _row_bytes(y)
            chosen = _resolve_algo(algo, y.is_cuda, slot_bytes, envs.NSA_CP_COALESCED_SCATTER_MIN_BYTES)
        _check_device_counts(device_counts, layout, y, compact)
        transport = select_p2p_transport(backend, group, "y", y, layout)
        return out_shape, chosen, transport, lambda: _signature(y, compact, chosen, transport, device_counts)

    rank, size, (out_shape, algo, transport, _) = _checked("cp_reduce_scatter", validate, layout, group, y, checks)
    return _reduce_scatter(y, layout, group, rank, size, compact, out, out_shape, algo, transport, device_counts)


def _reduce_scatter(y, layout, group, rank, size, compact, out, out_shape, algo, transport, device_counts):
    # NCCL sums whole slots whatever the counts, so device_counts changes nothing on that path
    if transport is not None and layout.total_len:
        return transport.reduce_scatter(y, layout, compact=compact, out=out, device_counts=device_counts)
    if layout.total_len == 0:
        return out if out is not None else y.new_empty(out_shape)
    if layout.is_even:
        if out is None:
            out = y.new_empty(out_shape)
        nccl.reduce_scatter_equal(out, y.contiguous(), group)
        return out
    if algo == "coalesced":
        if out is None:
            out = y.new_empty(out_shape)
        y = y.contiguous()
        inputs = [y[start:stop] for start, stop in (layout.rows(q, compact=True) for q in range(size))]
        nccl.reduce_scatter_uneven(out, inputs, group)
        return out
    if compact:
        padded = y.new_empty((layout.padded_len, *y.shape[1:]))
        _compact_to_padded(y, layout, padded)
        y = padded
    slot = y.new_empty((layout.max_rank_len, *y.shape[1:]))
    nccl.reduce_scatter_equal(slot, y.contiguous(), group)
    if out is None:
        return slot[:out_shape[0]]
    out.copy_(slot[:out_shape[0]])
    return out
