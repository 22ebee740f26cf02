import os
import sys

# Kernels run under Triton's interpreter on CPU tensors when there is no GPU; this must be set before
# triton.jit decorates anything, hence here.
try:
    import torch

    _has_cuda = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# the tests import the shared case / worker / harness modules of tests/support/ by module name (spawned
# workers inherit this path)
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "support"))

# A checkout in a folder named nsa_cp, and pytest started in its parent (`python -m pytest nsa_cp/tests`): Python
# looks in the current folder first and finds the checkout's folder, which has no __init__.py, before the
# installed package, so `nsa_cp` would be an empty namespace package and every test an AttributeError. Stop
# once, saying why. find_spec imports nothing.
def _namespace_shadow():
    import importlib.util

    spec = importlib.util.find_spec("nsa_cp")
    if spec is None or spec.origin not in (None, "namespace"):
        return None
    return ", ".join(spec.submodule_search_locations or ())


if _namespace_shadow():
    import pytest

    pytest.exit(f"'import nsa_cp' would import the folder {_namespace_shadow()} (the checkout's folder, as an empty "
                "namespace package), not the nsa_cp package inside it: Python looks in the current folder first, "
                "and this is the checkout's parent. Run pytest from inside the checkout (cd nsa_cp) or from "
                "any other folder.", returncode=4)
