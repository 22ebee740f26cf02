"""The padding share of vLLM 0.33.0's own PCP split: what NSA_CP_VLLM_COMPACT=1 saves the MoE there.

For each batch shape and PCP size, vLLM's own ``PCPManager._build_batch_layout`` (DualChunkSwap: every
prefill in 2P chunks of ceil(len / 2P), rank r taking chunks r and 2P-1-r; decodes round-robin, as
``pcp_shard_decode_requests`` defaults under PCP without DCP) gives the per-rank real counts ``n``; every
rank is padded to ``M = max(n)`` and vLLM's MoE gather is ``[P * M, H]``, the compact one ``[sum(n), H]``.
Prints a Markdown table of ``padding rows / (P * M)``. CPU only, no GPU, no timing, no process group.

    python benchmarks/vllm_padding.py

Needs vllm==0.33.0 (``bash .ci/install_vllm.sh``).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402  the engine import, the Markdown table

# name -> (query lengths, prefilling): decodes are 1-token queries
BATCHES = {
    "one request of 131072": ([131072], [True]),
    "one request of 8191": ([8191], [True]),
    "64 x 700": ([700] * 64, [True] * 64),
    "mix: 32768, 8000, 16 x 700, 8 x 37": ([32768, 8000] + [700] * 16 + [37] * 8, [True] * 26),
    "4096 prefill + 63 decodes": ([4096] + [1] * 63, [True] + [False] * 63),
    "37, 1, 1, 1, 10 (the issue's)": ([37, 1, 1, 1, 10], [True, False, False, False, True]),
}
PCPS = (2, 4, 8)


def counts(query_lens, prefilling, pcp: int):
    """vLLM's per-rank token counts of one step (its own layout code, on CPU)."""
    import numpy as np
    import torch
    from vllm.v1.worker.gpu.pcp_manager import PCPManager

    nst = np.array(query_lens, dtype=np.int32)
    qsl = np.zeros(len(nst) + 1, dtype=np.int32)
    np.cumsum(nst, out=qsl[1:])
    manager = PCPManager(pcp_world_size=pcp, pcp_rank=0, device=torch.device("cpu"), shard_decode_requests=True)
    _, per_rank = manager._build_batch_layout(nst, np.zeros_like(nst), np.array(prefilling, dtype=np.bool_), qsl)
    return per_rank


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Needs vllm==0.33.0 "
                            "(bash .ci/install_vllm.sh). Takes no arguments.").parse_args()
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    vllm = harness.import_engine("vllm", "vllm_padding.py", "vllm==0.33.0", ".ci/install_vllm.sh")

    print(f"vLLM {vllm.__version__}: padding rows / MoE rows of the padded gather ([P * M, H])\n")
    print(harness.markdown_head(["batch", "tokens"] + [f"PCP = {p}" for p in PCPS]))
    for name, (lens, prefilling) in BATCHES.items():
        cells = []
        for pcp in PCPS:
            n = counts(lens, prefilling, pcp)
            padded = max(n) * pcp
            cells.append(f"{100 * (padded - sum(n)) / padded:.2f}% ({padded - sum(n)} rows)")
        print(harness.markdown_row([name, sum(lens)] + cells))


if __name__ == "__main__":
    main()
