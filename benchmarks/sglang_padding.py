"""The padding share of SGLang 0.5.23's own CP splits: what NSA_CP_SGLANG_COMPACT=1 saves the MoE there.

For each batch shape and cp, SGLang's ``ZigzagCPStrategy.build_metadata`` / ``InterleaveCPStrategy
.build_metadata`` + ``cp/padding.pad_logical_token_to_physical`` give the per-rank real counts ``n`` and
the physical length ``P`` every rank is padded to; SGLang's MoE gather is ``[P * cp, H]``, the compact
one ``[sum(n), H]``. Prints a Markdown table of ``padding rows / (P * cp)``. CPU only, no GPU, no timing.

    python benchmarks/sglang_padding.py

Needs sglang==0.5.23 (``bash .ci/install_sglang.sh``); where no torchvision imports, the test stand-in
``tests/sglang_shims`` is put on the path (see its docstring).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from unittest import mock

BATCHES = {
    "one request of 131072": [131072],
    "one request of 8191": [8191],
    "64 x 700": [700] * 64,
    "mix: 32768, 8000, 16 x 700, 8 x 37": [32768, 8000] + [700] * 16 + [37] * 8,
    "mix: 4096 + 63 x 1..126": [4096] + [1 + (2 * i) % 126 for i in range(63)],
}
CPS = (2, 4, 8)


def _prepare():
    os.environ.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl.so")
    if importlib.util.find_spec("torchvision") is None:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "sglang_shims"))


def split(strategy: str, seq_lens, cp: int):
    """(real counts per rank, physical length) of SGLang's own split and padding."""
    from sglang.srt.layers.cp import padding
    from sglang.srt.layers.cp.interleave import InterleaveCPStrategy
    from sglang.srt.layers.cp.zigzag import ZigzagCPStrategy
    from sglang.srt.runtime_context import get_parallel

    cls = ZigzagCPStrategy if strategy == "zigzag" else InterleaveCPStrategy
    widths = dict(tp_size=cp, attn_cp_size=cp, attn_dp_size=1, pp_size=1, moe_ep_size=1, moe_dp_size=1,
                  attn_dcp_size=1, shared_experts_tp_size=None, attn_tp_size=1)
    with get_parallel().override(**widths), \
            mock.patch("sglang.srt.layers.cp.base.is_zigzag", return_value=strategy == "zigzag"), \
            mock.patch.object(cls, "cp_rank", new=property(lambda self: 0)):
        md = cls(cp).build_metadata(num_tokens=sum(seq_lens), seqs_len=list(seq_lens),
                                    extend_seqs_len=list(seq_lens))
        padding.pad_logical_token_to_physical(md)
    return list(md.per_rank_logical_token), md.per_rank_actual_token[0]


def main() -> None:
    _prepare()
    import sglang

    print(f"SGLang {sglang.__version__}: padding rows / MoE rows of the padded gather ([P * cp, H])\n")
    print("| batch | tokens | strategy | " + " | ".join(f"cp = {cp}" for cp in CPS) + " |")
    print("|---|---|---|" + "---|" * len(CPS))
    for name, lens in BATCHES.items():
        for strategy in ("zigzag", "interleave"):
            cells = []
            for cp in CPS:
                n, physical = split(strategy, lens, cp)
                padded = physical * cp
                cells.append(f"{100 * (padded - sum(n)) / padded:.3f}% ({padded - sum(n)} rows)")
            print(f"| {name} | {sum(lens)} | {strategy} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
