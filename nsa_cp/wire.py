"""The wire formats: what a quantized gather moves, defined once.

``"fp8_e4m3_g128"`` (SGLang's ``per_token_group_quant_fp8``): per row, groups of ``FP8_GROUP`` columns;
each group's amax (fp32) is clamped to at least ``FP8_AMAX_FLOOR``, ``scale = amax / FP8_MAX`` and
``q = clamp(x / scale, -FP8_MAX, FP8_MAX)`` as float8_e4m3fn. A gather returns ``(q, scale)``:
``q [rows, H]`` float8_e4m3fn and ``scale [rows, H / FP8_GROUP]`` fp32; padding rows hold ``q = 0``
and ``scale = FP8_PAD_SCALE``, what quantizing a zero row gives. The quantizers that implement it:
nsa_cp/reference.py (torch), nsa_cp/kernels/norm_rows.py (Triton), csrc/ (the P2P transport's fused push).
"""

import torch

__all__ = ["FP8_G128", "QUANTS", "FP8_GROUP", "FP8_MAX", "FP8_AMAX_FLOOR", "FP8_PAD_SCALE", "FP8_DTYPE"]

FP8_G128 = "fp8_e4m3_g128"  # the one quantized wire format
QUANTS = (None, FP8_G128)  # what ``quant=`` accepts
FP8_GROUP = 128  # columns per scale (DeepSeek-V3's activation block, SGLang's group_size)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_AMAX_FLOOR = 1e-10  # SGLang's eps for the group amax: an all-zero group gets a tiny, finite scale
# The scale of an all-zero group (and of every padding row): 1e-10 rounded to fp32, divided by 448 in fp32.
FP8_PAD_SCALE = float(torch.tensor(FP8_AMAX_FLOOR, dtype=torch.float32) / FP8_MAX)
FP8_DTYPE = getattr(torch, "float8_e4m3fn", None)
