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
