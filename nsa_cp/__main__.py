"""``python -m nsa_cp [--vars-only]``: every NSA_CP_* variable's current value (nsa_cp/envs.py), then
what this machine can run.

A module of its own that the package never imports: ``python -m`` runs it after importing ``nsa_cp``
(runpy warns when the module it runs was imported first, as a module the package imports would be).
"""

from __future__ import annotations

import os
from typing import Dict

from nsa_cp.envs import ENVIRONMENT_VARIABLES, describe, reader

__all__ = ["machine_report", "main"]


def machine_report() -> Dict[str, str]:
    """What this machine can run, for ``python -m nsa_cp``: versions, whether ``nsa_cp._C`` loaded (and
    why not), and whether the P2P transport and nsa_cp's native NCCL communicator can serve here. Local
    checks only (no process group): a group's own verdicts come from ``nsa_cp.p2p_unavailable_reason``
    / ``nsa_cp.nccl_unavailable_reason``. Initialises CUDA in this process."""
    import importlib.util

    import torch

    import nsa_cp
    from nsa_cp.rows import _native

    report = {"nsa_cp": f"{nsa_cp.__version__} ({os.path.dirname(nsa_cp.__file__)})",
              "torch": f"{torch.__version__} (CUDA {torch.version.cuda or 'none'})"}
    triton = importlib.util.find_spec("triton")
    report["triton"] = "installed" if triton is not None else "not installed (CUDA row kernels need it)"
    mod = _native.load()
    if mod is None:
        report["nsa_cp._C"] = f"not loaded: {_native.unavailable_reason()}"
    else:
        report["nsa_cp._C"] = f"loaded ({getattr(mod, '__file__', '?')})"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    report["CUDA devices"] = str(gpus) + "".join(f"; {i}: {torch.cuda.get_device_name(i)}" for i in range(gpus))
    if mod is None:
        p2p = nccl = f"no: {_native.unavailable_reason()}"
    elif not _native.available():
        p2p = nccl = f"no: {_native.unavailable_reason()}"
    else:
        bad = [f"cuda:{i}: {r}" for i in range(gpus) if (r := _native.device_support(i).reason)]
        no_peer = [f"{i}->{j}" for i in range(gpus) for j in range(gpus)
                   if i != j and not torch.cuda.can_device_access_peer(i, j)]
        if bad:
            p2p = "no: " + "; ".join(bad)
        elif no_peer:
            p2p = f"no peer access between GPUs {', '.join(no_peer)}"
        else:
            p2p = (f"yes: ranks on this node's {gpus} GPU(s), one GPU per rank or sharing one "
                   "(nsa_cp.init_p2p; not across nodes)")
        if not hasattr(mod, "NcclComm"):
            nccl = "no: nsa_cp._C has no NcclComm (built before it existed)"
        else:
            try:
                mod.nccl_library(reader("NSA_CP_NCCL_LIBRARY")())  # a bare name would miss __getattr__
                nccl = "yes: libnccl loads (nsa_cp.init_nccl on an NCCL group)"
            except (RuntimeError, ValueError) as err:
                nccl = f"no: {err}"
    report["P2P transport"] = p2p
    report["native NCCL communicator"] = nccl
    return report


def main(argv=None) -> int:
    """``python -m nsa_cp [--vars-only]``: every NSA_CP_* variable's current value, then this machine."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m nsa_cp",
        description="Print every NSA_CP_* environment variable (current value and meaning), then what this "
                    "machine can run: whether nsa_cp._C loaded (and why not), and whether the P2P transport "
                    "and nsa_cp's native NCCL communicator can serve here.")
    parser.add_argument("--vars-only", action="store_true", help="print the variables only (no CUDA initialisation)")
    args = parser.parse_args(argv)
    print("# environment variables (nsa_cp/envs.py)")
    for key, value in describe().items():
        print(f"{key}={value!r}  # {ENVIRONMENT_VARIABLES[key][1]}")
    if not args.vars_only:
        print("# this machine")
        for key, value in machine_report().items():
            print(f"{key}: {value}")
    return 0




if __name__ == "__main__":
    raise SystemExit(main())
