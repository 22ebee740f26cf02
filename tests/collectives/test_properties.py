"""Property test of the public API's bad-input contract on CPU/gloo.

Hypothesis draws one call at a time (layout, shape, dtype, strides, out, and a perturbation applied on one
"victim" rank or on every rank), a persistent gloo world (tests/dist_harness.WorldPool, spawned once per
world size) runs it on every rank with ``validate=True`` (tests/property_worker.handle), and the test
checks the contract:

* no rank raises anything but ValueError;
* if any rank raised, every rank raised ValueError (the validate=True contract: nobody is left hanging in
  a collective), and no rank's ``out`` was written;
* if no rank raised, every rank's result matches the independent reference (bit for bit for gathers,
  padding rows included; an fp64 sum with a dtype-scaled bound for reduce-scatters);
* perturbation-free calls never raise; calls with a surely invalid perturbation always raise.

The perturbations include ranks that disagree on the row shape, the dtype or the compact flag (caught
by validation's fingerprint of the call) and fp8, which a gather carries as bytes and a reduce-scatter
refuses.
"""

from __future__ import annotations

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, note, settings  # noqa: E402
from hypothesis.control import currently_in_test_context  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import property_worker as pw  # noqa: E402
from dist_harness import WorldPool  # noqa: E402

MAX_EXAMPLES = 200  # random examples per world size, on top of the 27 explicit ones (~5-15 ms each)
REQUEST_TIMEOUT_S = 60.0

SETTINGS = settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    derandomize=True,  # the same examples on every run and in CI
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=False,
)


# --------------------------------------------------------------------------- worlds
def _pool(world):
    pool = WorldPool(world, "gloo", pw.handle, timeout_s=REQUEST_TIMEOUT_S)
    try:
        yield pool
    finally:
        pool.close()


@pytest.fixture(scope="module")
def world2():
    yield from _pool(2)


@pytest.fixture(scope="module")
def world3():
    yield from _pool(3)


# --------------------------------------------------------------------------- strategies
# sampled_from over small domains: Hypothesis' integers() lean hard on their bounds (0 rows, 0 hidden)
_PERTURBATIONS = (
    [(k, "victim") for k in pw.KINDS_EITHER_SCOPE]
    + [(k, "all") for k in pw.KINDS_EITHER_SCOPE]
    + [(k, "victim") for k in pw.KINDS_VICTIM_ONLY]
    + [(k, "all") for k in pw.KINDS_ALL_ONLY]
)


@st.composite
def payloads(draw, world: int):
    shape = draw(st.sampled_from(["random", "random", "random", "zero", "even"]))
    if shape == "random":  # counts 0..9 per rank
        counts = draw(st.lists(st.sampled_from(range(10)), min_size=world, max_size=world))
    elif shape == "zero":  # nobody holds a token
        counts = [0] * world
    else:
        counts = [draw(st.sampled_from(range(1, 10)))] * world
    hidden = st.sampled_from([1, 2, 3, 4, 5, 6, 8, 0])  # 0: empty rows, drawn now and then
    rest = draw(st.one_of(st.tuples(hidden), st.tuples(st.sampled_from([1, 2, 3]), hidden)))  # 2-D or 3-D
    perturb = None
    if draw(st.sampled_from([False, False, True, True, True])):  # ~40 % of the calls are valid
        kind, scope = draw(st.sampled_from(_PERTURBATIONS))
        arg = draw(st.sampled_from([-2, -1, 1, 2] if kind == "rows" else range(8)))
        perturb = {"kind": kind, "scope": scope, "victim": draw(st.sampled_from(range(world))), "arg": arg}
    return {
        "seed": draw(st.integers(0, 2**20)),
        "op": draw(st.sampled_from(["gather", "scatter"])),
        "compact": draw(st.booleans()),
        "counts": counts,
        "align": draw(st.sampled_from([1, 2, 3, 4])),
        "counts_form": draw(st.sampled_from(["list", "tuple", "tensor"])),
        "group": draw(st.sampled_from(["none", "world"])),
        "dtype": draw(st.sampled_from(pw.PROPERTY_DTYPES)),
        "rest": rest,
        "stride": draw(st.sampled_from(pw.STRIDES)),
        "out": draw(st.booleans()),
        "perturb": perturb,
    }


def coverage_examples(world: int):
    """One explicit payload per perturbation (kind, scope), plus valid calls of every op/compact/stride:
    every kind is exercised whatever the random draw does. Parameters rotate deterministically."""
    layouts = [([3, 0, 5][:world], 2), ([4] * world, 1), ([2, 7, 1][:world], 3), ([0] * world, 1), ([5, 1, 1][:world], 4)]
    rests = [(5,), (2, 3), (8,), (3, 1), (1,)]
    cases = [(None, None)] * 12 + _PERTURBATIONS
    examples = []
    for i, perturb in enumerate(cases):
        counts, align = layouts[i % len(layouts)]
        if perturb != (None, None):
            kind, scope = perturb
            perturb = {"kind": kind, "scope": scope, "victim": i % world, "arg": (1 if kind == "rows" else i % 8)}
        else:
            perturb = None
        examples.append({
            "seed": 1000 + i, "op": ("gather", "scatter")[i % 2], "compact": bool((i // 2) % 2),
            "counts": list(counts), "align": align, "counts_form": ("list", "tuple", "tensor")[i % 3],
            "group": ("none", "world")[(i // 3) % 2], "dtype": pw.PROPERTY_DTYPES[i % 3], "rest": rests[i % len(rests)],
            "stride": pw.STRIDES[i % len(pw.STRIDES)], "out": bool((i // 4) % 2), "perturb": perturb,
        })
    return examples


def with_coverage_examples(world: int):
    def decorate(test):
        for payload in coverage_examples(world):
            test = example(payload=payload)(test)
        return test

    return decorate


# --------------------------------------------------------------------------- the contract
def check_contract(pool: WorldPool, payload: dict) -> None:
    if currently_in_test_context():
        note(f"payload = {payload!r}")
    answers = pool.run(payload)
    lines = "\n".join(f"  rank {r}: {a!r}" for r, a in enumerate(answers))
    context = f"payload {payload!r}\nper-rank answers:\n{lines}"

    others = [(r, a[1]) for r, a in enumerate(answers) if a[0] == "other_error"]
    assert not others, "a call raised something other than ValueError:\n" + "\n".join(
        f"rank {r}:\n{tb}" for r, tb in others) + f"\n{context}"
    wrong = [(r, a[1]) for r, a in enumerate(answers) if a[0] == "wrong_result"]
    assert not wrong, f"wrong result on rank(s) {wrong}\n{context}"

    raised = [a[0] == "value_error" for a in answers]
    expect = pw.expected_outcome(payload)
    if any(raised):
        assert all(raised), f"some ranks raised ValueError, others returned (validate=True contract)\n{context}"
        written = [r for r, a in enumerate(answers) if not a[2]]
        assert not written, f"rank(s) {written} raised but wrote `out`\n{context}"
        assert expect != "ok", f"a valid call raised\n{context}"
        p = payload["perturb"]
        if p["scope"] == "victim" and p["kind"] in pw.LOCAL_KINDS:
            # the victim raises its own ValueError, every other rank the agreement's LayoutMismatchError
            for r, a in enumerate(answers):
                is_mismatch = a[1].startswith("LayoutMismatchError")
                assert is_mismatch == (r != p["victim"]), f"rank {r} raised the wrong kind of error\n{context}"
    else:
        assert expect != "raise", f"an invalid call was accepted on every rank\n{context}"


@SETTINGS
@with_coverage_examples(2)
@given(payload=payloads(2))
def test_contract_world2(world2, payload):
    check_contract(world2, payload)


@SETTINGS
@with_coverage_examples(3)
@given(payload=payloads(3))
def test_contract_world3(world3, payload):
    check_contract(world3, payload)


# --------------------------------------------------------------------------- the strategy reaches every kind
def test_strategy_covers_every_kind():
    """Each perturbation kind (and scope) is in the strategy and the explicit examples."""
    kinds = {kind for kind, _ in _PERTURBATIONS}
    assert kinds == set(pw.KINDS)
    for world in (2, 3):
        covered = {(p["perturb"]["kind"], p["perturb"]["scope"]) for p in coverage_examples(world) if p["perturb"]}
        assert covered == set(_PERTURBATIONS)
