"""Several runs of examples/nsa_prefill.py in one launch: one process group, one start-up.

The arguments before the first ``::`` are every run's; each ``::`` starts one run, with its own
arguments after it (none: the common ones alone)::

    torchrun --nproc-per-node 8 examples/nsa_prefill_sweep.py --device cuda --hidden 1024 --comm all \\
        :: :: --enable-nsa-prefill-cp-shared-kv :: --enable-nsa-prefill-cp-shared-kv --quant fp8_e4m3_g128

On CUDA with more local ranks than GPUs the ranks share the GPUs (the example's one-GPU mode: a gloo
group, nsa_cp's data over the P2P transport through CUDA IPC). Every run prints the example's own lines;
a line ``sweep: run <i> rc=<rc> ...`` per run and the exit status (1 if any run failed) come last. The
group's timeout (``--sweep-timeout-s S`` first, default 300) bounds a run whose rank failed while the
others wait in a collective.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import sys
import time

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))


def _example():
    spec = importlib.util.spec_from_file_location("nsa_prefill", os.path.join(HERE, "nsa_prefill.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]) or "::" not in argv:
        print(__doc__)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    timeout_s = 300.0
    if argv[0] == "--sweep-timeout-s":
        timeout_s, argv = float(argv[1]), argv[2:]
    groups, current = [], []
    for token in argv + ["::"]:
        if token == "::":
            groups.append(current)
            current = []
        else:
            current.append(token)
    common, runs = groups[0], groups[1:-1] if not groups[-1] else groups[1:]
    example = _example()
    cuda = example.parse_args(common + runs[0]).device == "cuda"
    if cuda:
        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise SystemExit("--device cuda: no CUDA device visible")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % gpus)
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        backend = "nccl" if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) <= gpus else "gloo"
    else:
        backend = "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    results = []
    try:
        for i, run in enumerate(runs):
            started = time.perf_counter()
            if dist.get_rank() == 0:
                print(f"sweep: run {i}: {' '.join(common + run)}", flush=True)
            try:
                rc = example.main(common + run)
            except SystemExit as e:  # the example's argument errors
                rc = e.code if isinstance(e.code, int) else 1
                if dist.get_rank() == 0:
                    print(f"sweep: run {i} exited: {e}", flush=True)
            results.append((i, rc, time.perf_counter() - started, run))
            if cuda:
                torch.cuda.empty_cache()
    finally:
        import nsa_cp

        if len(results) == len(runs):  # every run finished on every rank: the collective clean-up
            nsa_cp.transport.destroy_p2p(None)
            nsa_cp.transport.destroy_nccl(None)
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        for i, rc, seconds, run in results:
            print(f"sweep: run {i} rc={rc} {seconds:.1f} s: {' '.join(run)}", flush=True)
    return 0 if all(rc == 0 for _, rc, _, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
