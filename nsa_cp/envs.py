"""Every NSA_CP_* environment variable, in one place.

Each variable is read when it is used (not at import), so tests and launchers may set it late; only its
parse is cached, for as long as the raw value stays the same. Read them
as attributes: ``envs.NSA_CP_COMPACT_ALGO``. ``python -m nsa_cp`` (nsa_cp/__main__.py) prints the current values and
what this machine can run (``--help``).

setup.py cannot import the package while building; it reads NSA_CP_BUILD_CUDA and NSA_CP_CUDA_ARCHS
itself, with the meanings documented here.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional, Tuple, Union

__all__ = ["ENVIRONMENT_VARIABLES", "PLAN_VARIABLES", "describe", "plan_state", "reader"]

_UNSET = object()
# CPython keeps os.environ's values in a dict (``_data``, encoded keys and values) that every write
# through os.environ updates. Looking a key up there costs a small fraction of os.environ.get, and the
# hot path of every collective reads 2-5 variables, so readers use it when it exists.
_ENVIRON_DATA = (
    os.environ._data  # type: ignore[attr-defined]
    if all(hasattr(os.environ, a) for a in ("_data", "encodekey", "decodevalue"))
    else None
)


class _Reader:
    """Reads one variable when called: the raw value on every call (so a value set late is seen), the
    parse only when the raw value changed since the last call (a bad value raises on every call)."""

    def __init__(self, name: str, parse: Callable[[Optional[str]], Any]):
        self.name, self.parse = name, parse
        self._key = os.environ.encodekey(name) if _ENVIRON_DATA is not None else None
        self._raw, self._value = _UNSET, None

    def __call__(self) -> Any:
        if self._key is not None:
            raw = _ENVIRON_DATA.get(self._key)  # the stored object: unchanged value, same object
        else:
            raw = os.environ.get(self.name)
        if raw is not self._raw:
            text = os.environ.decodevalue(raw) if raw is not None and self._key is not None else raw
            self._value, self._raw = self.parse(text), raw
        return self._value


def _choice(name: str, default: str, choices: Union[Tuple[str, ...], Callable[[], Tuple[str, ...]]]) -> _Reader:
    def parse(raw: Optional[str]) -> str:
        value = (default if raw is None else raw).strip().lower()
        if raw is None:
            return value  # the default (the choices may need the package: this file also loads alone)
        allowed = choices() if callable(choices) else choices
        if value not in allowed:
            raise ValueError(f"{name}: expected one of {allowed}, got {value!r}")
        return value

    return _Reader(name, parse)


def _transport_names() -> Tuple[str, ...]:
    from . import transports  # the table's names (read when the variable is; this file also loads alone)

    return transports.names()


def _int(name: str, default: int, minimum: int = 0) -> _Reader:
    def parse(raw: Optional[str]) -> int:
        if raw is None or raw.strip() == "":
            return default
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{name}: expected an integer, got {raw!r}") from None
        if value < minimum:
            raise ValueError(f"{name}: expected an integer >= {minimum}, got {value}")
        return value

    return _Reader(name, parse)


def _flag(name: str, default: bool) -> _Reader:
    def parse(raw: Optional[str]) -> bool:
        if raw is None or raw.strip() == "":
            return default
        value = raw.strip().lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}: expected 0/1 (or true/false), got {raw!r}")

    return _Reader(name, parse)


# name -> (reader, one-line meaning)
ENVIRONMENT_VARIABLES: Dict[str, Tuple[Callable[[], Any], str]] = {
    "NSA_CP_COMPACT_ALGO": (
        _choice("NSA_CP_COMPACT_ALGO", "auto", ("auto", "padded", "coalesced")),
        "compact-layout algorithm on CUDA: 'padded' (padded NCCL collective + one Triton "
        "compact/expand kernel), 'coalesced' (grouped NCCL broadcasts/reduces straight into the "
        "compact buffer), or 'auto' (by size, see NSA_CP_COALESCED_GATHER_MIN_BYTES and _SCATTER_MIN_BYTES)",
    ),
    "NSA_CP_COALESCED_GATHER_MIN_BYTES": (
        _int("NSA_CP_COALESCED_GATHER_MIN_BYTES", 16 << 20),
        "with NSA_CP_COMPACT_ALGO=auto: a compact gather whose rank slot (max_rank_len rows) holds at "
        "least this many bytes takes the coalesced algorithm, smaller ones the padded one (the crossover "
        "measured: docs/performance.md)",
    ),
    "NSA_CP_COALESCED_SCATTER_MIN_BYTES": (
        _int("NSA_CP_COALESCED_SCATTER_MIN_BYTES", 0),
        "the same for the compact reduce-scatter (0: coalesced always; docs/performance.md)",
    ),
    "NSA_CP_BACKEND": (
        _choice("NSA_CP_BACKEND", "auto", lambda: ("auto", *_transport_names())),
        "transport when a call says backend='auto': one of nsa_cp/transports.py's rows always ('nccl': "
        "torch.distributed, 'p2p': needs nsa_cp.init_p2p), or 'auto': the first row that serves the call "
        "(P2P for uneven layouts when a transport fits, NCCL otherwise)",
    ),
    "NSA_CP_VALIDATE": (
        _flag("NSA_CP_VALIDATE", False),
        "check on every call, with one small all-reduce, that all ranks hold the same layout and valid "
        "input; raise LayoutMismatchError / ValueError on every rank otherwise (calls with "
        "validate=None follow this)",
    ),
    "NSA_CP_AGREEMENT": (
        _choice("NSA_CP_AGREEMENT", "auto", ("auto", "separate", "off")),
        "the torch.distributed path's check on every call that the ranks agree (a fingerprint gathered beside "
        "the rows): 'auto' (on NCCL in the same NCCL group as the rows' collective where it can, else a tiny "
        "all-gather just before; gloo: before the rows), 'separate' (always the tiny all-gather before), "
        "'off'. Must be the same on every rank",
    ),
    "NSA_CP_ROW_KERNELS": (
        _choice("NSA_CP_ROW_KERNELS", "auto", ("auto", "native", "triton")),
        "the NCCL path's pack / compact / expand kernels on CUDA: 'native' (nsa_cp._C), 'triton' (the "
        "Triton kernels: the same copies, more host time per launch), or 'auto': "
        "native when nsa_cp._C has kernels for the tensors' GPU, else Triton",
    ),
    "NSA_CP_NCCL_CALL": (
        _choice("NSA_CP_NCCL_CALL", "auto", ("auto", "direct", "public")),
        "how the NCCL/gloo path calls its collectives: 'auto' (the uneven movements of a group with "
        "nsa_cp.init_nccl take its native NCCL communicator, everything else as 'direct'), 'direct' "
        "(the process group's own method, bound once per plan: the same collective without the Python "
        "around the public function) or 'public' (torch.distributed's functions)",
    ),
    "NSA_CP_NCCL_LIBRARY": (
        _Reader("NSA_CP_NCCL_LIBRARY", lambda raw: (raw or "").strip()),
        "nsa_cp.init_nccl: the libnccl to open (a path); unset: the copy torch loaded, else the "
        "loader's libnccl.so.2",
    ),
    "NSA_CP_P2P_ENGINE": (
        _choice("NSA_CP_P2P_ENGINE", "auto", ("auto", "sm", "ce")),
        "P2P gather engine: 'sm' (one CUDA kernel pushes with 16-byte stores), 'ce' (copy engine, "
        "no SMs busy), or 'auto' (by size, see NSA_CP_P2P_CE_MIN_BYTES)",
    ),
    "NSA_CP_P2P_CE_MIN_BYTES": (
        _int("NSA_CP_P2P_CE_MIN_BYTES", 1 << 62),
        "with NSA_CP_P2P_ENGINE=auto: a rank slot of at least this many bytes takes the copy engine",
    ),
    "NSA_CP_P2P_MEMORY": (
        _choice("NSA_CP_P2P_MEMORY", "auto", ("auto", "symm_mem", "cuda_ipc")),
        "how the P2P transport maps its peers' buffers: 'symm_mem' (torch symmetric memory, one GPU per "
        "rank), 'cuda_ipc' (CUDA IPC handles of ordinary allocations, as torch.multiprocessing shares "
        "them; only for ranks that all share one GPU: across GPUs it is refused), "
        "or 'auto': cuda_ipc when the ranks share a GPU, else symm_mem",
    ),
    "NSA_CP_P2P_DOUBLE_BUFFER_TOKENS": (
        _int("NSA_CP_P2P_DOUBLE_BUFFER_TOKENS", 1024),
        "P2P transports created without double_buffer_tokens=: tokens per rank of the second gather "
        "buffer (capped at max_tokens_per_rank; 0: none). Back-to-back gathers of up to this many rows "
        "per rank alternate between the two buffers and skip the entry barrier",
    ),
    "NSA_CP_P2P_TIMEOUT_MS": (
        _int("NSA_CP_P2P_TIMEOUT_MS", 60_000),
        "how long a P2P call waits for a peer before it gives up and reports P2PTimeoutError "
        "(0: wait forever)",
    ),
    "NSA_CP_SGLANG": (
        _flag("NSA_CP_SGLANG", True),
        "SGLang plugin (entry point nsa_cp, group sglang.srt.plugins): 1 registers nsa_cp's CP moves "
        "on SGLang's layer_boundary._cp_moves in every scheduler process; 0 registers nothing (logged)",
    ),
    "NSA_CP_SGLANG_COMPACT": (
        _flag("NSA_CP_SGLANG_COMPACT", False),
        "inside SGLang: 0 keeps SGLang's padded [physical * cp, H] MoE gather; 1 gathers only the real "
        "rows, [sum(per_rank_logical_token), H], so the MoE skips the padding rows (docs/sglang.md)",
    ),
    "NSA_CP_SGLANG_P2P": (
        _flag("NSA_CP_SGLANG_P2P", True),
        "inside SGLang: 1 creates the attention-CP group's P2P transport in every scheduler (after the "
        "model loads, before SGLang sizes its KV cache) where the group is on one node and P2P can serve "
        "it, sized from SGLang's prefill limits; 0 never (nsa_cp's NCCL path)",
    ),
    "NSA_CP_SGLANG_OVERLAP": (
        _flag("NSA_CP_SGLANG_OVERLAP", False),
        "inside SGLang: 1 runs a DeepSeek decoder layer's MoE section as the overlapped boundary (router "
        "and routed experts on each rank's rows as they land, a replicated shared expert once on the "
        "rank's own rows, one rounding); configurations it does not serve keep the serialized path, "
        "said in status() (docs/sglang.md); 0 the serialized path always",
    ),
    "NSA_CP_SGLANG_OVERLAP_CHUNK_ROWS": (
        _int("NSA_CP_SGLANG_OVERLAP_CHUNK_ROWS", 0),
        "with NSA_CP_SGLANG_OVERLAP=1: the overlapped boundary's chunk_rows (0: each rank's rows one "
        "chunk, the schedule benchmarks/overlap.py measured; smaller chunks cost a MoE launch each and "
        "are not measured). Must be the same on every rank (the call's fingerprint checks it)",
    ),
    "NSA_CP_SGLANG_OVERLAP_MIN_ROWS": (
        _int("NSA_CP_SGLANG_OVERLAP_MIN_ROWS", 4096),
        "with NSA_CP_SGLANG_OVERLAP=1: a batch whose largest rank holds fewer rows (max_rank_len) keeps the "
        "serialized boundary, where a MoE call per rank's rows costs more than the overlap hides (measured "
        "at 2048 rows per rank, docs/performance.md); 0 overlaps every batch",
    ),
    "NSA_CP_VLLM": (
        _flag("NSA_CP_VLLM", True),
        "vLLM plugin (entry point nsa_cp, group vllm.general_plugins): 1 routes the prefill-CP MoE gather "
        "and reduce-scatter through nsa_cp in every worker; 0 patches nothing (logged)",
    ),
    "NSA_CP_VLLM_COMPACT": (
        _flag("NSA_CP_VLLM_COMPACT", False),
        "inside vLLM: 0 keeps vLLM's padded [P * M, H] MoE gather; 1 gathers only the real rows (hidden "
        "states and router logits), with forward_context.is_padding describing the same rows (docs/vllm.md)",
    ),
    "NSA_CP_VLLM_P2P": (
        _flag("NSA_CP_VLLM_P2P", True),
        "inside vLLM: 1 creates the PCP group's P2P transport in every worker (after the model loads, "
        "before vLLM profiles memory for its KV cache) where the group is on one node and P2P can serve "
        "it, sized from max_num_batched_tokens; 0 never (nsa_cp's NCCL path)",
    ),
    "NSA_CP_FIRST_USE_CHECKS": (
        _int("NSA_CP_FIRST_USE_CHECKS", 1),
        "engine plugins (SGLang, vLLM): on the first N calls of each kind of move in a process, also run the "
        "engine's own move on the same inputs and compare (bitwise for data movement, a stated bound for "
        "sums); a difference declines that kind for the process (one warning, status()['first_use']) and "
        "the call returns the engine's own result. 0: no checks",
    ),
    "NSA_CP_BUILD_CUDA": (
        _choice("NSA_CP_BUILD_CUDA", "auto", ("auto", "0", "1")),
        "setup.py: build nsa_cp._C with nvcc ('1'), never ('0'), or when nvcc is found ('auto')",
    ),
    "NSA_CP_CUDA_ARCHS": (
        _Reader("NSA_CP_CUDA_ARCHS", lambda raw: raw or ""),
        "setup.py: ';'-separated CUDA archs for nsa_cp._C, e.g. '90a;100a' (default 90a, plus "
        "100a where nvcc supports it); set where nvcc is not found, the build fails (NSA_CP_BUILD_CUDA=0: pure)",
    ),
}


# The variables a cached plan (nsa_cp/planning/plan.py) depends on: their raw values are part of its key, so a
# change takes effect on the next call.
PLAN_VARIABLES = (
    "NSA_CP_COMPACT_ALGO", "NSA_CP_COALESCED_GATHER_MIN_BYTES", "NSA_CP_COALESCED_SCATTER_MIN_BYTES",
    "NSA_CP_BACKEND", "NSA_CP_ROW_KERNELS", "NSA_CP_NCCL_CALL", "NSA_CP_AGREEMENT", "NSA_CP_P2P_ENGINE", "NSA_CP_P2P_CE_MIN_BYTES",
)
_PLAN_KEYS = tuple(os.environ.encodekey(n) for n in PLAN_VARIABLES) if _ENVIRON_DATA is not None else None


def plan_state() -> Tuple[Any, ...]:
    """The raw values of PLAN_VARIABLES (None where unset): cheap, one dict lookup each."""
    if _PLAN_KEYS is not None:
        return tuple(map(_ENVIRON_DATA.get, _PLAN_KEYS))
    return tuple([os.environ.get(n) for n in PLAN_VARIABLES])


def describe() -> Dict[str, Any]:
    """Current value of every variable (errors shown as strings)."""
    values = {}
    for name, (reader, _) in ENVIRONMENT_VARIABLES.items():
        try:
            values[name] = reader()
        except ValueError as err:
            values[name] = f"<invalid: {err}>"
    return values


def reader(name: str) -> Callable[[], Any]:
    """The reader of one variable, for hot paths that bind it once (``envs.NAME`` goes through the
    module's ``__getattr__`` on every read)."""
    return ENVIRONMENT_VARIABLES[name][0]


def __getattr__(name: str) -> Any:
    entry = ENVIRONMENT_VARIABLES.get(name)
    if entry is None:
        raise AttributeError(f"module 'nsa_cp.envs' has no attribute {name!r}")
    return entry[0]()


def __dir__():
    return sorted(list(globals()) + list(ENVIRONMENT_VARIABLES))
