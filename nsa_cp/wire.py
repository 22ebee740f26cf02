"""The wire formats: what a quantized gather moves, defined once (its object here, its kernels beside).

A ``WireFormat`` holds everything a layer above the kernels asks of a format: its name (what ``quant=``
takes), the result streams a gather returns, what its rows need (``support``), the torch reference
quantizer and its native code. ``FORMATS`` lists them by name; ``format_of(quant)`` is the one lookup.
Adding a format touches this module, the Triton quantizer (nsa_cp/kernels/norm_rows.py), the native
side (csrc/codes.h: its code and group size, which nsa_cp._C exports; csrc/p2p_gather.cu: the P2P
kernel's quantizing stage and its dispatch on the code): docs/design.md, "Wire formats".

``fp8_e4m3_g128`` (SGLang's ``per_token_group_quant_fp8``): per row, groups of ``FP8_GROUP`` columns;
each group's amax (fp32) is clamped to at least ``FP8_AMAX_FLOOR``, ``scale = amax / FP8_MAX`` and
``q = clamp(x / scale, -FP8_MAX, FP8_MAX)`` as float8_e4m3fn. A gather returns ``(q, scale)``:
``q [rows, H]`` float8_e4m3fn and ``scale [rows, H / FP8_GROUP]`` fp32; padding rows hold ``q = 0``
and ``scale = FP8_PAD_SCALE``, what quantizing a zero row gives.
"""

from typing import Optional, Tuple

import torch

from .support import Support

__all__ = ["WireFormat", "FORMATS", "format_of", "FP8_E4M3_G128", "FP8_G128", "QUANTS", "FP8_GROUP", "FP8_MAX",
           "FP8_AMAX_FLOOR", "FP8_PAD_SCALE", "FP8_DTYPE"]

FP8_GROUP = 128  # columns per scale (DeepSeek-V3's activation block, SGLang's group_size)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_AMAX_FLOOR = 1e-10  # SGLang's eps for the group amax: an all-zero group gets a tiny, finite scale
# The scale of an all-zero group (and of every padding row): 1e-10 rounded to fp32, divided by 448 in fp32.
FP8_PAD_SCALE = float(torch.tensor(FP8_AMAX_FLOOR, dtype=torch.float32) / FP8_MAX)
FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)


class WireFormat:
    """A quantized wire format: rows of ``H`` elements become ``q [H]`` in ``dtype`` plus one fp32 scale
    per ``group`` columns. ``short``: the suffix of its torch.library ops (``cp_all_gather_<short>``);
    ``native_code``: the name of its code in nsa_cp._C (the P2P kernel's)."""

    __slots__ = ("name", "short", "group", "max", "amax_floor", "pad_scale", "dtype", "native_code")

    def __init__(self, name: str, short: str, group: int, max_: float, amax_floor: float, dtype, native_code: str):
        self.name, self.short, self.group, self.max, self.amax_floor = name, short, group, max_, amax_floor
        self.dtype, self.native_code = dtype, native_code
        self.pad_scale = float(torch.tensor(amax_floor, dtype=torch.float32) / max_)

    def streams(self, hidden: int) -> Tuple[tuple, tuple]:
        """The gather's result streams ``(row shape, result dtype, dtype on the wire)``: q and its scales."""
        return ((hidden,), self.dtype, torch.uint8), ((hidden // self.group,), torch.float32, torch.float32)

    def support(self, hidden: int) -> Support:
        """Whether rows of ``hidden`` elements can take this format (a no says what they need)."""
        if hidden % self.group:
            return Support.no(f"quant={self.name!r} needs a hidden size that is a multiple of {self.group}")
        return Support.yes()

    def quantize_reference(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``x [rows, H]`` -> ``(q [rows, H], scale [rows, H / group] fp32)`` in torch (the definition)."""
        rows, h = x.shape
        with torch.no_grad():
            groups = x.detach().to(torch.float32).reshape(rows, h // self.group, self.group)
            amax = groups.abs().amax(dim=-1, keepdim=True).clamp_min(self.amax_floor)
            scale = amax / torch.full_like(amax, self.max)  # a true division on CUDA too (reference.rmsnorm_fp32)
            q = (groups / scale).clamp(-self.max, self.max).to(self.dtype)
        return q.reshape(rows, h), scale.reshape(rows, h // self.group)

    def dequantize_reference(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``q * scale`` in fp32, rounded once to ``dtype``."""
        rows, h = q.shape
        groups = q.to(torch.float32).reshape(rows, h // self.group, self.group)
        return (groups * scale.to(torch.float32).reshape(rows, h // self.group, 1)).reshape(rows, h).to(dtype)

    def __repr__(self) -> str:
        return f"WireFormat({self.name!r})"


FP8_E4M3_G128 = WireFormat("fp8_e4m3_g128", "fp8", FP8_GROUP, FP8_MAX, FP8_AMAX_FLOOR, FP8_DTYPE, "QUANT_FP8_E4M3_G128")
FP8_G128 = FP8_E4M3_G128.name  # what quant= takes for it
FORMATS = {f.name: f for f in (FP8_E4M3_G128,)}
QUANTS = (None, *FORMATS)  # what ``quant=`` accepts


def format_of(quant: Optional[str]) -> Optional[WireFormat]:
    """The format named ``quant`` (None for None); ValueError naming ``quant`` for an unknown name."""
    if quant is None:
        return None
    fmt = FORMATS.get(quant) if isinstance(quant, str) else None
    if fmt is None:
        raise ValueError(f"quant: expected one of {QUANTS}, got {quant!r}")
    return fmt
