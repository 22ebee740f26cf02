"""The padding share of SGLang 0.5.23's own CP splits: what NSA_CP_SGLANG_COMPACT=1 saves the MoE there.

For each batch shape and cp, SGLang's ``ZigzagCPStrategy.build_metadata`` / ``InterleaveCPStrategy
.build_metadata`` + ``cp/padding.pad_logical_token_to_physical`` give the per-rank real counts ``n`` and
the physical length ``P`` every rank is padded to; SGLang's MoE gather is ``[P * cp, H]``, the compact
one ``[sum(n), H]``. Prints a Markdown table of ``padding rows / (P * cp)``. CPU only, no GPU, no timing.

    python benchmarks/sglang_padding.py

Needs sglang==0.5.23 (``bash .ci/install_sglang.sh``); the metadata comes from the tests' SGLang
environment (``tests/support/sglang_env.py``, which needs no pytest for this).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "support"))
import sglang_env  # noqa: E402  SGLang's own metadata on a CPU-only machine (the tests' stand-ins)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  the engine import, the Markdown table

BATCHES = {
    "one request of 131072": [131072],
    "one request of 8191": [8191],
    "64 x 700": [700] * 64,
    "mix: 32768, 8000, 16 x 700, 8 x 37": [32768, 8000] + [700] * 16 + [37] * 8,
    "mix: 4096 + 63 x 1..126": [4096] + [1 + (2 * i) % 126 for i in range(63)],
}
CPS = (2, 4, 8)


def split(strategy: str, seq_lens, cp: int):
    """(real counts per rank, physical length) of SGLang's own split and padding (the tests' builder of
    SGLang's metadata, tests/support/sglang_env.py)."""
    md, logical = sglang_env.build_metadata(seq_lens, cp, strategy)
    return logical, md.per_rank_actual_token[0]


def main() -> None:
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Needs sglang==0.5.23 "
                            "(bash .ci/install_sglang.sh). Takes no arguments.").parse_args()
    sglang_env.prepare_process()
    sglang = harness.import_engine("sglang", "sglang_padding.py", "sglang==0.5.23", ".ci/install_sglang.sh")

    print(f"SGLang {sglang.__version__}: padding rows / MoE rows of the padded gather ([P * cp, H])\n")
    print(harness.markdown_head(["batch", "tokens", "strategy"] + [f"cp = {cp}" for cp in CPS]))
    for name, lens in BATCHES.items():
        for strategy in ("zigzag", "interleave"):
            cells = []
            for cp in CPS:
                n, physical = split(strategy, lens, cp)
                padded = physical * cp
                cells.append(f"{100 * (padded - sum(n)) / padded:.3f}% ({padded - sum(n)} rows)")
            print(harness.markdown_row([name, sum(lens), strategy] + cells))


if __name__ == "__main__":
    main()
