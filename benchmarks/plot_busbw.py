"""Plot bus bandwidth against size per method from a gather_scatter.py CSV; writes a PNG beside it.

    python benchmarks/plot_busbw.py benchmarks/results/2xH200.csv [--imbalance 0.2]

One panel per direction (all-gather, reduce-scatter), x = bytes of one rank slot (M rows), y = busbw
(GB/s, nccl-tests convention, see gather_scatter.py), one line per method, for the layouts whose
second rank holds round(M * (1 - imbalance)) rows. Needs matplotlib.
"""

import argparse
import csv
import os
from collections import defaultdict


def load(path, imbalance):
    series = defaultdict(list)  # (direction, method) -> [(slot bytes, busbw)]
    for row in csv.DictReader(open(path)):
        counts = [int(c) for c in row["counts"].split("/")]
        m = int(row["max_rank_len"])
        if len(counts) < 2 or counts[1] != round(m * (1 - imbalance)):
            continue
        slot_bytes = m * int(row["hidden"]) * (2 if row["dtype"] in ("bf16", "fp16") else 4)
        series[(row["direction"], row["method"])].append((slot_bytes, float(row["busbw_GBps"])))
    return series


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv")
    parser.add_argument("--imbalance", type=float, default=0.2)
    parser.add_argument("--out", default=None, help="PNG path (default: the CSV's, .png)")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = load(args.csv, args.imbalance)
    fig, axes = plt.subplots(1, 2, figsize=(14, 5.5))
    for ax, (direction, title) in zip(axes, (("ag", "all-gather"), ("rs", "reduce-scatter"))):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # up to 20 methods, each its own colour
        for (d, method), points in sorted(series.items()):
            if d != direction:
                continue
            points.sort()
            xs, ys = zip(*points)
            style = "-" if method.startswith(("nsa_", "p2p_")) else "--"
            ax.plot(xs, ys, style, marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per rank slot (M x H x dtype)")
        ax.set_ylabel("busbw (GB/s)")
        ax.set_title(f"{title}, counts [M, {1 - args.imbalance:g}M]")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(os.path.basename(args.csv))
    fig.tight_layout()
    out = args.out or os.path.splitext(args.csv)[0] + ".png"
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main()
