"""The row kernel's machine code per variant, compiled ahead of time for sm_90 on a machine without a GPU.

``nsa_cp.rows.kernels.norm_rows._rows_kernel`` at the production row length (H = 7168, bf16, residual, device
count), for each stage (add + RMSNorm into the slot, + FP8 quantization, the FP8 quantizer alone) and each
``CAST_ROUNDS`` (False: the interpreter's integer rounding, True: the GPU's casts): SASS instructions per
thread, straight-line (the row is unrolled), by opcode, and warp instructions a row (a thread's count times
the launch's warps: what the SMs issue for one row, comparable across launch shapes). A kernel that issues
more instructions per byte than the bf16 norm stage (HBM-bound on 1x H200) is likely issue-bound: this is a
guide for what to try before a GPU run, not a timing.

    python3 scripts/norm_rows_sass.py            # needs Triton (its bundled ptxas and cuobjdump), no GPU
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import tempfile
from typing import Tuple

STAGES = {"norm": dict(NORM=True, QUANT=False), "norm+fp8": dict(NORM=True, QUANT=True),
          "fp8 quant": dict(NORM=False, QUANT=True)}
SIGNATURE = {"x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "q_ptr": "*fp8e4nv",
             "scale_ptr": "*fp32", "count_ptr": "*i32", "x_rows": "i32", "eps": "fp32", "pad_scale": "fp32",
             "fmax": "fp32", "amax_floor": "fp32", "scale_floor": "fp32", "x_stride": "i32", "res_stride": "i32", "y_stride": "i32", "q_stride": "i32", "scale_stride": "i32"}


def sass(stage: str, cast_rounds: bool, hidden: int) -> Tuple[int, str]:
    """``(num_warps, SASS text)`` of the kernel one row of ``hidden`` elements launches."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from nsa_cp.rows.kernels import norm_rows

    fn = norm_rows._rows_kernel
    if not isinstance(fn, triton.runtime.JITFunction):
        raise RuntimeError("nsa_cp's kernels were decorated under TRITON_INTERPRET=1: run this without it")
    block_g, group, chunks, warps = norm_rows._geometry(hidden, 128 if STAGES[stage]["QUANT"] else 0,
                                                       STAGES[stage]["NORM"])
    consts = dict(ROW_LEN=hidden, HAS_RESIDUAL=STAGES[stage]["NORM"], HAS_COUNT=True, BLOCK_G=block_g, GROUP=group,
                  CHUNKS=chunks,
                  IS_BF16=True, CAST_ROUNDS=cast_rounds, FMA_ROUNDS_ONCE=True,
                  CAST_SATURATES=cast_rounds and STAGES[stage]["QUANT"], POW2_SCALES=False, **STAGES[stage])
    signature = dict(SIGNATURE, **{k: "constexpr" for k in consts})
    # what a launch specializes on (Triton's JIT): 16-byte aligned pointers and strides divisible by 16
    # (contiguous [rows, 7168] tensors; the scale rows, H / 128 = 56 floats, are not)
    aligned = [n for n, t in SIGNATURE.items() if t.startswith("*")] + ["x_stride", "res_stride", "y_stride",
                                                                         "q_stride"]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn=fn, signature=signature, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "enable_fp_fusion": False})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return warps, subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def opcodes(text: str) -> collections.Counter:
    ops = re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T] )?([A-Z0-9]+)", text, re.M)
    return collections.Counter(ops)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--top", type=int, default=8, help="opcodes listed per variant")
    args = parser.parse_args()
    os.environ.pop("TRITON_INTERPRET", None)  # the compiled kernel (nsa_cp's kernels are imported after this)
    print(f"| stage | CAST_ROUNDS | SASS instructions per thread | warp instructions a row | top opcodes (H = "
          f"{args.hidden}, bf16, sm_90) |")
    print("|---|---|---|---|---|")
    for stage in STAGES:
        for cast_rounds in (False, True):
            warps, text = sass(stage, cast_rounds, args.hidden)
            ops = opcodes(text)
            top = ", ".join(f"{op} {n}" for op, n in ops.most_common(args.top))
            print(f"| {stage} | {cast_rounds} | {sum(ops.values())} | {sum(ops.values()) * warps} | {top} |")


if __name__ == "__main__":
    main()
