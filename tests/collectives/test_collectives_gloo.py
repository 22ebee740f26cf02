"""Multi-rank checks of cp_all_gather / cp_reduce_scatter / the communicator on gloo (CPU).

One process group per world size runs every case of tests/support/dist_cases.py (spawned once, see
dist_harness.gloo_case_test); each case is its own test item so a failure names the case.
"""

import dist_cases
from dist_harness import gloo_case_test

test_case = gloo_case_test(dist_cases, world_sizes=(1, 2, 3, 4, 8))
