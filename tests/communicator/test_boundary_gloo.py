"""The layer boundary (fused norm + gather, FP8 wire, reduce-scatter + norm, ordered gather, chained
communicators, autograd, bad input) on gloo with CPU tensors: tests/support/boundary_cases.py, one item per case
and world size (dist_harness.gloo_case_test)."""

import boundary_cases
from dist_harness import gloo_case_test

test_case = gloo_case_test(boundary_cases, world_sizes=(1, 2, 3, 4, 8))
