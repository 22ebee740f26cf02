"""What every rank does for one property-test payload (tests/collectives/test_properties.py, run in a WorldPool).

A payload is a plain dict, the same on every rank, describing ONE call of the public API:

    seed        int: every rank regenerates every rank's inputs from it (the reference needs them)
    op          "gather" (cp_all_gather) | "scatter" (cp_reduce_scatter)
    compact     bool
    counts      per-rank token counts (the layout), one per rank
    align       int >= 1
    counts_form "list" | "tuple" | "tensor": how the counts are handed to ShardLayout (all valid)
    group       "none" | "world": group=None or dist.group.WORLD
    dtype       "bf16" | "fp16" | "fp32"
    rest        trailing dims: (H,) for 2-D tensors, (A, B) for 3-D
    stride      one of STRIDES: how the input's memory is laid out (the values do not depend on it, except
                "expanded", whose rows are all one row)
    out         bool: pass a NaN-poisoned ``out`` of the right shape
    perturb     None, or {"kind": one of KINDS, "scope": "victim" | "all", "victim": rank, "arg": int}:
                something wrong done on the victim rank only (or on every rank)

Every call uses ``validate=True``, so one rank's bad input makes every rank raise instead of hanging.
``handle`` returns, per rank, one of

    ("ok", {"checksum": float, "shape": tuple})   the call returned and matched the reference
    ("wrong_result", message)                      it returned something else, or modified its input
    ("value_error", "Type: message", out_untouched)
    ("other_error", traceback)                     any other exception (a library bug, or a test bug)

The reference is independent of nsa_cp: plain torch.cat / zero rows for gathers (compared bit for bit,
padding rows included), an fp64 sum with a dtype-scaled bound for reduce-scatters.
"""

from __future__ import annotations

import traceback
from typing import Optional, Tuple

import torch

import oracles

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "fp8": torch.float8_e4m3fn}
# gloo carries fp16, bf16 and fp32 (and more) for these collectives; fp8 only as bytes (see "fp8")
PROPERTY_DTYPES = ("bf16", "fp16", "fp32")

STRIDES = (
    "contiguous",
    "colmajor",  # transposed, made contiguous, transposed back: reversed strides, not contiguous
    "rows_strided",  # every other row of a NaN-filled buffer: non-contiguous along dim 0
    "cols_sliced",  # the middle of a wider NaN-filled last dim: non-contiguous trailing dims
    "offset",  # contiguous, but starts one row into a NaN-filled buffer (storage offset)
    "expanded",  # one row expanded to n rows: stride 0 along dim 0
)

# perturbations: which scopes each may take
KINDS_EITHER_SCOPE = (
    "rows",  # input with arg (+-1, +-2) rows too many
    "ndim1",  # input flattened to 1-D
    "not_tensor",  # input passed as a nested list
    "out_shape",  # out of a wrong shape (arg picks how)
    "out_dtype",  # out of another dtype
    "out_noncontig",  # out of the right shape but strided (an error only when it is not contiguous)
    "algo_bad",  # algo="fast" (checked by the compact paths only)
    "backend_bad",  # backend="mpi"
    "backend_p2p",  # backend="p2p" without nsa_cp.init_p2p
)
KINDS_VICTIM_ONLY = (
    "layout_counts",  # the victim's layout has one count + 1
    "layout_align",  # the victim's layout has align + 1
    "layout_cp_size",  # the victim's layout has another number of ranks
    "layout_type",  # the victim passes the counts list instead of a ShardLayout
    "op_swap",  # the victim calls the other collective (with inputs right for it)
    "compact_flip",  # the victim uses the other compact flag (inputs right for it)
    "hidden_mismatch",  # the victim's trailing dim is one larger (its out matches it)
    "dtype_mismatch",  # the victim uses another dtype (its out matches it)
)
KINDS_ALL_ONLY = (
    "bad_layout_ctor",  # every rank builds ShardLayout from bad arguments
    "fp8",  # every rank uses float8_e4m3fn: a gather carries it as bytes, a reduce-scatter refuses it
)
KINDS = KINDS_EITHER_SCOPE + KINDS_VICTIM_ONLY + KINDS_ALL_ONLY

# rank-local invalid input: the victim raises its own ValueError, the others LayoutMismatchError
LOCAL_KINDS = frozenset(KINDS_EITHER_SCOPE) | {"layout_cp_size", "layout_type"}

_BAD_CTORS = (
    lambda c: ((*c[:-1], -1), {}),
    lambda c: (c, {"align": 0}),
    lambda c: (c, {"align": -2}),
    lambda c: ((True, *c[1:]), {}),
    lambda c: ((), {}),
    lambda c: ((2.5, *c[1:]), {}),
    lambda c: (c, {"align": True}),
    lambda c: (c, {"align": 2.0}),
)
_OTHER_DTYPE = {"fp32": ("bf16", "fp16"), "bf16": ("fp32", "fp16"), "fp16": ("fp32", "bf16"), "fp8": ("fp32", "bf16")}


# --------------------------------------------------------------------------- plan: what this rank passes
def _max_rank_len(counts, align: int) -> int:
    return -(-max(counts) // align) * align


def _global_len(counts, align: int, compact: bool) -> int:
    return sum(counts) if compact else _max_rank_len(counts, align) * len(counts)


def _rows_of(counts, align: int, rank: int, compact: bool) -> Tuple[int, int]:
    start = sum(counts[:rank]) if compact else rank * _max_rank_len(counts, align)
    return start, start + counts[rank]


def affected(payload: dict, rank: int) -> bool:
    p = payload.get("perturb")
    return bool(p) and (p["scope"] == "all" or p["victim"] == rank)


def rank_plan(payload: dict, rank: int) -> dict:
    """This rank's call: the payload with the perturbation applied when it hits this rank."""
    world = len(payload["counts"])
    counts = list(payload["counts"])
    align = payload["align"]
    plan = dict(op=payload["op"], compact=payload["compact"], layout_counts=counts, layout_align=align,
                layout_form="layout", ctor=None, dtype=payload["dtype"], rest=tuple(payload["rest"]),
                in_form="tensor", rows_delta=0, out=payload["out"], out_dtype=payload["dtype"], out_shape=None,
                out_noncontig=None, algo="auto", backend="auto")
    if not affected(payload, rank):
        return plan
    kind, arg = payload["perturb"]["kind"], payload["perturb"].get("arg", 0)
    if kind == "compact_flip":
        plan["compact"] = not plan["compact"]
    elif kind == "op_swap":
        plan["op"] = "scatter" if plan["op"] == "gather" else "gather"
    elif kind == "layout_counts":
        changed = counts[:]
        changed[arg % world] += 1
        plan["layout_counts"] = changed
    elif kind == "layout_align":
        plan["layout_align"] = align + 1
    elif kind == "layout_cp_size":
        plan["layout_counts"] = counts + [arg % 4] if (arg % 2 == 0 or world == 1) else counts[:-1]
    elif kind == "layout_type":
        plan["layout_form"] = "list"
    elif kind == "bad_layout_ctor":
        plan["layout_form"] = "ctor"
        plan["ctor"] = arg % len(_BAD_CTORS)
    elif kind == "rows":
        plan["rows_delta"] = arg or 1
    elif kind == "ndim1":
        plan["in_form"] = "1d"
    elif kind == "not_tensor":
        plan["in_form"] = "list"
    elif kind == "out_shape":
        plan["out"] = True
        plan["out_shape"] = arg % 4
    elif kind == "out_dtype":
        plan["out"] = True
        plan["out_dtype"] = _OTHER_DTYPE[plan["dtype"]][arg % 2]
    elif kind == "out_noncontig":
        plan["out"] = True
        plan["out_noncontig"] = arg % 2
    elif kind == "algo_bad":
        plan["algo"] = "fast"
    elif kind == "backend_bad":
        plan["backend"] = "mpi"
    elif kind == "backend_p2p":
        plan["backend"] = "p2p"
    elif kind == "hidden_mismatch":
        plan["rest"] = plan["rest"][:-1] + (plan["rest"][-1] + 1,)
    elif kind == "dtype_mismatch":
        plan["dtype"] = plan["out_dtype"] = _OTHER_DTYPE[plan["dtype"]][0]
    elif kind == "fp8":
        plan["dtype"] = plan["out_dtype"] = "fp8"
    else:
        raise KeyError(f"unknown perturbation {kind!r}")
    return plan


def input_rows(payload: dict, plan: dict, rank: int) -> int:
    """Rows of this rank's input (from the payload's true layout, then the rows perturbation)."""
    counts, align = payload["counts"], payload["align"]
    rows = counts[rank] if plan["op"] == "gather" else _global_len(counts, align, plan["compact"])
    delta = plan["rows_delta"]
    return rows + delta if rows + delta >= 0 else rows - delta


def out_shape(payload: dict, plan: dict, rank: int) -> tuple:
    counts, align = payload["counts"], payload["align"]
    rows = _global_len(counts, align, plan["compact"]) if plan["op"] == "gather" else counts[rank]
    shape = (rows, *plan["rest"])
    variant = plan["out_shape"]
    if variant == 0:
        shape = (rows + 1, *plan["rest"])
    elif variant == 1:
        shape = (rows - 1 if rows else rows + 2, *plan["rest"])
    elif variant == 2:
        shape = (rows, *plan["rest"][:-1], plan["rest"][-1] + 1)
    elif variant == 3:
        shape = (*shape, 1)
    return shape


# --------------------------------------------------------------------------- tensors
def logical(seed: int, q: int, rows: int, rest, dtype: torch.dtype, stride: str, salt: int = 0) -> torch.Tensor:
    """Rank q's input values (a function of the payload only, so any rank can rebuild any rank's input)."""
    g = torch.Generator().manual_seed((seed * 1009 + q) * 7 + salt)
    t = torch.randn((1 if stride == "expanded" else rows, *rest), generator=g, dtype=torch.float32).to(dtype)
    return t.expand(rows, *rest) if stride == "expanded" else t


def materialize(t: torch.Tensor, stride: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(view, buffer)``: a tensor equal to ``t`` with the requested memory layout, and all its storage."""
    nan = float("nan")
    if stride == "contiguous":
        v = t.clone(memory_format=torch.contiguous_format)
        return v, v
    if stride == "colmajor":
        perm = tuple(reversed(range(t.dim())))
        v = t.permute(perm).contiguous().permute(perm)
        return v, v
    if stride == "rows_strided":
        buf = torch.full((2 * t.shape[0], *t.shape[1:]), nan, dtype=t.dtype)
        buf[::2] = t
        return buf[::2], buf
    if stride == "cols_sliced":
        buf = torch.full((*t.shape[:-1], t.shape[-1] + 2), nan, dtype=t.dtype)
        buf[..., 1:-1] = t
        return buf[..., 1:-1], buf
    if stride == "offset":
        buf = torch.full((t.shape[0] + 1, *t.shape[1:]), nan, dtype=t.dtype)
        buf[1:] = t
        return buf[1:], buf
    if stride == "expanded":
        return t, t
    raise KeyError(stride)


def build_out(payload: dict, plan: dict, rank: int):
    """``(out, buffer)`` poisoned with NaN, or ``(None, None)``."""
    if not plan["out"]:
        return None, None
    shape = out_shape(payload, plan, rank)
    dtype = DTYPES[plan["out_dtype"]]
    how = plan["out_noncontig"]
    if how == 0 and len(shape) >= 2:  # the first two dims swapped in memory
        buf = torch.full((shape[1], shape[0], *shape[2:]), float("nan"), dtype=dtype)
        return buf.transpose(0, 1), buf
    if how is not None:  # a slice of a wider last dim
        buf = torch.full((*shape[:-1], shape[-1] + 1), float("nan"), dtype=dtype)
        return buf[..., : shape[-1]], buf
    buf = torch.full(shape, float("nan"), dtype=dtype)
    return buf, buf


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(bits(a), bits(b))


# --------------------------------------------------------------------------- expectations (used by the test)
def expected_outcome(payload: dict) -> str:
    """"ok" (must succeed and match), "raise" (every rank must raise ValueError) or "either"."""
    p = payload.get("perturb")
    if not p:
        return "ok"
    kind = p["kind"]
    if kind == "fp8":
        # a gather moves bits (fp8 travels as uint8); a sum of fp8 is refused with ValueError
        return "ok" if payload["op"] == "gather" else "raise"
    if kind == "out_noncontig":
        ranks = [r for r in range(len(payload["counts"])) if affected(payload, r)]
        strided = any(not build_out(payload, rank_plan(payload, r), r)[0].is_contiguous() for r in ranks)
        return "raise" if strided else "ok"
    return "raise"


def reference(payload: dict, rank: int) -> torch.Tensor:
    """What ``rank`` must get back, from the payload alone (each rank's own compact flag)."""
    counts, align, seed, stride = payload["counts"], payload["align"], payload["seed"], payload["stride"]
    world = len(counts)
    plans = [rank_plan(payload, q) for q in range(world)]
    mine = plans[rank]
    rest, dtype = tuple(payload["rest"]), DTYPES[mine["dtype"]]  # the plan's: "fp8" changes it on every rank
    if mine["op"] == "gather":
        shards = [logical(seed, q, counts[q], rest, dtype, stride) for q in range(world)]
        if mine["compact"]:
            return torch.cat(shards)
        m = _max_rank_len(counts, align)
        pieces = []
        for shard in shards:
            pieces += [shard, torch.zeros((m - shard.shape[0], *rest), dtype=dtype)]
        return torch.cat(pieces)
    partials = []
    for q in range(world):
        y = logical(seed, q, _global_len(counts, align, plans[q]["compact"]), rest, dtype, stride, salt=1)
        start, stop = _rows_of(counts, align, rank, plans[q]["compact"])
        partials.append(y[start:stop])
    return torch.stack(partials) if partials else torch.empty(0)


# --------------------------------------------------------------------------- one call
def _make_layout(nsa_cp, plan: dict, payload: dict):
    counts = plan["layout_counts"]
    if plan["layout_form"] == "list":
        return list(counts)
    if plan["layout_form"] == "ctor":
        args, kwargs = _BAD_CTORS[plan["ctor"]](tuple(counts))
        return nsa_cp.ShardLayout(args, **kwargs)
    form = payload.get("counts_form", "list")
    if form == "tuple":
        counts = tuple(counts)
    elif form == "tensor":
        counts = torch.tensor(counts, dtype=torch.int64)
    return nsa_cp.ShardLayout(counts, align=plan["layout_align"])


def _call(nsa_cp, plan, layout, inp, out, group):
    kwargs = dict(compact=plan["compact"], out=out, algo=plan["algo"], backend=plan["backend"], validate=True)
    if plan["op"] == "gather":
        return nsa_cp.cp_all_gather(inp, layout, group, **kwargs)
    return nsa_cp.cp_reduce_scatter(inp, layout, group, **kwargs)


def _check_ok(payload, plan, rank, result, out, inp_buf, inp_snap) -> Optional[str]:
    if not isinstance(result, torch.Tensor):
        return f"returned {type(result).__name__}, not a tensor"
    if not same_bits(inp_buf, inp_snap):
        return "the call modified its input"
    if out is not None and (result.data_ptr() != out.data_ptr() or result.shape != out.shape):
        return "the result is not the given out tensor"
    expected = reference(payload, rank)
    dtype = DTYPES[plan["dtype"]]
    if plan["op"] == "gather":
        if not same_bits(result, expected):
            if tuple(result.shape) != tuple(expected.shape) or result.dtype != expected.dtype:
                return f"gather gave {tuple(result.shape)} {result.dtype}, expected {tuple(expected.shape)} {expected.dtype}"
            bad = (bits(result).view(result.shape[0], -1) != bits(expected).view(expected.shape[0], -1)).any(1)
            return f"gathered rows differ from the reference at rows {bad.nonzero().flatten().tolist()[:12]}"
        return None
    want_shape = (payload["counts"][rank], *plan["rest"])
    if tuple(result.shape) != want_shape or result.dtype != dtype:
        return f"reduce-scatter gave {tuple(result.shape)} {result.dtype}, expected {want_shape} {dtype}"
    return oracles.check_sum(result, list(expected), dtype)  # the fp64 bound every test uses


def handle(rank: int, world: int, payload: dict):
    """WorldPool handler: one call on this rank; never raises (see the module docstring for the answers)."""
    try:
        import torch.distributed as dist

        import nsa_cp

        plan = rank_plan(payload, rank)
        dtype = DTYPES[plan["dtype"]]
        salt = 0 if plan["op"] == "gather" else 1
        values = logical(payload["seed"], rank, input_rows(payload, plan, rank), plan["rest"], dtype,
                         payload["stride"], salt)
        inp, inp_buf = materialize(values, payload["stride"])
        if plan["in_form"] == "1d":
            inp = inp.reshape(-1)
        elif plan["in_form"] == "list":
            inp = inp.tolist()
        out, out_buf = build_out(payload, plan, rank)
        inp_snap = inp_buf.clone()
        out_snap = out_buf.clone() if out_buf is not None else None
        group = dist.group.WORLD if payload.get("group") == "world" else None
    except Exception:
        return ("other_error", "property_worker could not build this rank's inputs (a test bug):\n"
                + traceback.format_exc())
    try:
        layout = _make_layout(nsa_cp, plan, payload)
        result = _call(nsa_cp, plan, layout, inp, out, group)
    except ValueError as err:
        if not same_bits(inp_buf, inp_snap):
            return ("wrong_result", f"the input was modified by a call that raised {type(err).__name__}: {err}")
        untouched = out_buf is None or same_bits(out_buf, out_snap)
        return ("value_error", f"{type(err).__name__}: {err}", untouched)
    except Exception:
        return ("other_error", traceback.format_exc())
    try:
        problem = _check_ok(payload, plan, rank, result, out, inp_buf, inp_snap)
    except Exception:
        return ("other_error", "property_worker could not check the result (a test bug):\n" + traceback.format_exc())
    if problem:
        return ("wrong_result", problem)
    return ("ok", {"checksum": float(result.double().sum()) if result.numel() else 0.0, "shape": tuple(result.shape)})
