"""The wire formats: what a quantized gather moves, defined once as data (its traits here, the same
traits once more in csrc/codes.h for the P2P kernels, which are templated on them).

A ``WireFormat`` holds everything a layer above the kernels asks of a format: its name (what ``quant=``
takes), its traits, the result streams a gather returns, what its rows need (``support``) and the torch
reference quantizer, which defines it. ``FORMATS`` lists them by name; ``format_of(quant)`` is the one
lookup. The Triton quantizer (nsa_cp/rows/kernels/norm_rows.py) reads the traits; the P2P transport serves a
format whose traits ``nsa_cp._C.WIRE_FORMATS`` repeats exactly (``native_mismatch``). Adding a format is a
row here and a struct in csrc/codes.h: docs/design.md, "Wire formats".

Every format: per row, groups of ``group`` columns; ``amax = max |x|`` in fp32, clamped to at least
``amax_floor``; ``scale = amax / max`` (correctly rounded), clamped to at least ``scale_floor``, and with
``pow2_scales`` rounded up to a power of two (exactly: the next power of two unless it is one);
``q = clamp(x / scale, -max, max)`` as float8_e4m3fn (nearest even). A gather returns ``(q, scale)``:
``q [rows, H]`` float8_e4m3fn and ``scale [rows, H / group]`` fp32, row-major; padding rows hold ``q = 0``
and ``scale = pad_scale``, what quantizing a zero row gives.

- ``fp8_e4m3_g128``: SGLang's ``per_token_group_quant_fp8`` (group 128, fp32 scales as they come).
- ``fp8_e4m3_g128_ue8m0``: vLLM's ``per_token_group_quant_fp8(..., use_ue8m0=True)``, the power-of-two
  scales DeepGEMM takes on Blackwell: ``scale = 2^ceil(log2(max(amax / 448, 1e-10)))``, amax >= 1e-10.
  vLLM computes the power as ``exp2f(ceilf(log2f(s)))``; the two agree for every bf16 and fp16 row (such
  an amax has at most 11 significant bits, so ``amax / 448`` is a power of two or lies at least 1e-4
  above one). For fp32 rows they can differ where ``amax / 448`` lies within about 1e-6 above a power of
  two: there ``log2f`` rounds to the integer, vLLM's scale is the lower power and its largest q saturates.
"""

from typing import Optional, Tuple

import torch

from ..support import Support

__all__ = ["WireFormat", "FORMATS", "format_of", "native_mismatch", "FP8_E4M3_G128", "FP8_E4M3_G128_UE8M0",
           "FP8_G128", "QUANTS", "FP8_GROUP", "FP8_MAX", "FP8_AMAX_FLOOR", "FP8_PAD_SCALE", "FP8_DTYPE", "FP8_DTYPES"]

FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)
# every float8 dtype this torch has: a gather carries them as uint8 (the same bits)
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                   if hasattr(torch, n))
_EXPONENT_MASK = -(1 << 23)  # 0xFF800000 as int32: sign and exponent of an fp32
_MANTISSA_ONES = (1 << 23) - 1
_FP32_INF_BITS = 0x7F800000


def pow2_up(scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``scale`` (positive) rounded up to a power of two, exactly: adding the mantissa's all-ones
    carries into the exponent unless the mantissa is zero; inf and NaN are left as they are."""
    u = scale.contiguous().view(torch.int32)
    up = torch.bitwise_and(u + _MANTISSA_ONES, _EXPONENT_MASK)
    return torch.where(u < _FP32_INF_BITS, up, u).view(torch.float32)


class WireFormat:
    """A quantized wire format (module docstring): rows of ``H`` elements become ``q [H]`` in ``dtype`` plus one
    fp32 scale per ``group`` columns. ``code``: its code in the call fingerprint and in csrc/codes.h (< 8);
    ``short``: the suffix of its torch.library ops (``cp_all_gather_<short>``)."""

    __slots__ = ("name", "short", "code", "group", "max", "amax_floor", "scale_floor", "pow2_scales", "dtype",
                 "pad_scale")

    def __init__(self, name: str, short: str, code: int, *, group: int, max_: float, amax_floor: float,
                 scale_floor: float = 0.0, pow2_scales: bool = False, dtype=FP8_DTYPE):
        if not 0 < code < 8:
            raise ValueError(f"code: a wire format's code rides in 3 fingerprint bits: expected 1..7, got {code}")
        self.name, self.short, self.code, self.group = name, short, code, group
        self.max, self.amax_floor, self.scale_floor, self.pow2_scales = max_, amax_floor, scale_floor, pow2_scales
        self.dtype = dtype
        self.pad_scale = float(self.group_scales(torch.zeros(1, dtype=torch.float32))[0])

    @property
    def native_name(self) -> str:
        """Its code's name in nsa_cp._C (and csrc/codes.h): ``QUANT_<NAME>``."""
        return "QUANT_" + self.name.upper()

    def traits(self) -> dict:
        """The traits csrc/codes.h repeats (``nsa_cp._C.WIRE_FORMATS`` rows), fp32 values as fp32 rounds them."""
        f32 = lambda v: float(torch.tensor(v, dtype=torch.float32))  # noqa: E731
        return {"name": self.native_name, "code": self.code, "group": self.group, "max": f32(self.max),
                "amax_floor": f32(self.amax_floor), "scale_floor": f32(self.scale_floor),
                "pow2_scales": bool(self.pow2_scales)}

    def streams(self, hidden: int) -> Tuple[tuple, tuple]:
        """The gather's result streams ``(row shape, result dtype, dtype on the wire)``: q and its scales."""
        return ((hidden,), self.dtype, torch.uint8), ((hidden // self.group,), torch.float32, torch.float32)

    def support(self, hidden: int) -> Support:
        """Whether rows of ``hidden`` elements can take this format (a no says what they need)."""
        if hidden % self.group:
            return Support.no(f"quant={self.name!r} needs a hidden size that is a multiple of {self.group}")
        return Support.yes()

    def group_scales(self, amax: torch.Tensor) -> torch.Tensor:
        """fp32 group amax (any shape) -> the groups' scales (module docstring)."""
        amax = amax.to(torch.float32).clamp_min(self.amax_floor)
        scale = amax / torch.full_like(amax, self.max)  # a true division on CUDA too (reference.rmsnorm_fp32)
        if self.scale_floor:
            scale = scale.clamp_min(self.scale_floor)
        return pow2_up(scale) if self.pow2_scales else scale

    def quantize_reference(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``x [rows, H]`` -> ``(q [rows, H], scale [rows, H / group] fp32)`` in torch (the definition)."""
        rows, h = x.shape
        with torch.no_grad():
            groups = x.detach().to(torch.float32).reshape(rows, h // self.group, self.group)
            scale = self.group_scales(groups.abs().amax(dim=-1, keepdim=True))
            q = (groups / scale).clamp(-self.max, self.max).to(self.dtype)
        return q.reshape(rows, h), scale.reshape(rows, h // self.group)

    def dequantize_reference(self, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``q * scale`` in fp32, rounded once to ``dtype``."""
        rows, h = q.shape
        groups = q.to(torch.float32).reshape(rows, h // self.group, self.group)
        return (groups * scale.to(torch.float32).reshape(rows, h // self.group, 1)).reshape(rows, h).to(dtype)

    def __repr__(self) -> str:
        return f"WireFormat({self.name!r})"


FP8_E4M3_G128 = WireFormat("fp8_e4m3_g128", "fp8", 1, group=128, max_=448.0, amax_floor=1e-10)
FP8_E4M3_G128_UE8M0 = WireFormat("fp8_e4m3_g128_ue8m0", "fp8_ue8m0", 2, group=128, max_=448.0, amax_floor=1e-10,
                                 scale_floor=1e-10, pow2_scales=True)
FORMATS = {f.name: f for f in (FP8_E4M3_G128, FP8_E4M3_G128_UE8M0)}
QUANTS = (None, *FORMATS)  # what ``quant=`` accepts (format_of reads FORMATS itself)

# the first format's constants under the names the FP8 wire has always had
FP8_G128 = FP8_E4M3_G128.name
FP8_GROUP = FP8_E4M3_G128.group  # columns per scale (DeepSeek-V3's activation block, SGLang's group_size)
FP8_MAX = FP8_E4M3_G128.max  # largest finite float8_e4m3fn
FP8_AMAX_FLOOR = FP8_E4M3_G128.amax_floor  # SGLang's eps: an all-zero group gets a tiny, finite scale
FP8_PAD_SCALE = FP8_E4M3_G128.pad_scale  # 1e-10 rounded to fp32, divided by 448 in fp32


def native_mismatch(fmt: WireFormat, C) -> Optional[str]:
    """None when nsa_cp._C's kernels are built for ``fmt`` with the same traits, else what differs."""
    rows = {row["name"]: row for row in getattr(C, "WIRE_FORMATS", ())}
    row = rows.get(fmt.native_name)
    if row is None:
        return f"quant {fmt.name!r}: nsa_cp._C has no kernels for it (it knows {sorted(rows)})"
    want = fmt.traits()
    differs = [f"{k} {row.get(k)!r} != {v!r}" for k, v in want.items() if row.get(k) != v]
    return f"quant {fmt.name!r}: nsa_cp._C's traits differ from nsa_cp.geometry.wire's: {', '.join(differs)}" if differs else None


def format_of(quant: Optional[str]) -> Optional[WireFormat]:
    """The format named ``quant`` (None for None); ValueError naming ``quant`` for an unknown name."""
    if quant is None:
        return None
    fmt = FORMATS.get(quant) if isinstance(quant, str) else None
    if fmt is None:
        raise ValueError(f"quant: expected one of {(None, *FORMATS)}, got {quant!r}")
    return fmt
