"""Tests for nsa_cp.geometry.split: the page-aligned zigzag in-seq split (CPU only, fast)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nsa_cp.geometry.split import _block_bounds, in_seq_positions, in_seq_restore_index, in_seq_split

FUNCS = [in_seq_split, in_seq_positions, in_seq_restore_index]


# ----------------------------------------------------------------- independent reference
def reference_positions(seq_lens, cp_size, page_size):
    """Brute force: list pages, deal them to blocks one by one, give each block to its owner rank."""
    nb = 2 * cp_size
    owner_of_block = {}
    for r in range(cp_size):
        owner_of_block[r] = r
        owner_of_block[nb - 1 - r] = r
    first = [[] for _ in range(cp_size)]   # the rank's lower block, every request
    second = [[] for _ in range(cp_size)]  # the rank's upper block, every request
    offset = 0
    for L in seq_lens:
        pages = []
        s = 0
        while s < L:
            pages.append(list(range(offset + s, offset + min(s + page_size, L))))
            s += page_size
        blocks = [[] for _ in range(nb)]
        page_idx = 0
        for b in range(nb):
            count = len(pages) // nb
            if b < len(pages) % nb:
                count += 1
            for _ in range(count):
                blocks[b].extend(pages[page_idx])
                page_idx += 1
        assert page_idx == len(pages)
        for b in range(nb):
            r = owner_of_block[b]
            (first if b == r else second)[r].extend(blocks[b])
        offset += L
    return [first[r] + second[r] for r in range(cp_size)]


def random_batch(rng):
    cp = rng.randint(1, 8)
    page = rng.choice([1, 2, 7, 64])
    n = rng.randint(0, 12)
    lens = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.15:
            lens.append(0)
        elif kind < 0.4:
            lens.append(rng.randint(1, 2 * cp))           # shorter than 2*cp (or equal)
        elif kind < 0.6:
            lens.append(rng.randint(1, 4 * cp * page))    # fewer pages than a few per block
        else:
            lens.append(rng.randint(0, 3000))
    return lens, cp, page


# ----------------------------------------------------------------- published / documented cases
def test_sglang_two_requests():
    assert in_seq_split([9, 10], 4) == [6, 5, 4, 4]


def test_sglang_one_request():
    assert in_seq_split([1010], 4) == [253, 253, 252, 252]


def test_design_padding_example():
    counts = in_seq_split([700] * 64, 8, page_size=64)
    assert counts == [4096] * 5 + [7936, 8192, 8192]
    assert sum(counts) == 700 * 64


def test_docstring_example():
    assert in_seq_split([7], 2, page_size=2) == [3, 4]
    pos = in_seq_positions([7, 3], 2, page_size=2)
    assert [p.tolist() for p in pos] == [[0, 1, 7, 8, 6], [2, 3, 9, 4, 5]]


# ----------------------------------------------------------------- against the brute force
@pytest.mark.parametrize("lens,cp,page", [([9, 10], 4, 1), ([1010], 4, 1), ([700] * 64, 8, 64)])
def test_reference_agrees_on_documented_cases(lens, cp, page):
    assert [len(p) for p in reference_positions(lens, cp, page)] == in_seq_split(lens, cp, page)


def test_matches_reference_random_batches():
    rng = random.Random(1234)
    for _ in range(150):
        lens, cp, page = random_batch(rng)
        ref = reference_positions(lens, cp, page)
        assert in_seq_split(lens, cp, page) == [len(p) for p in ref], (lens, cp, page)
        got = in_seq_positions(lens, cp, page)
        assert len(got) == cp
        for r in range(cp):
            assert got[r].dtype == torch.int64 and got[r].dim() == 1
            assert got[r].tolist() == ref[r], (lens, cp, page, r)


@settings(max_examples=100, deadline=None)
@given(
    lens=st.lists(st.integers(0, 300), max_size=6),
    cp=st.integers(1, 8),
    page=st.sampled_from([1, 2, 3, 7, 64]),
)
def test_matches_reference_hypothesis(lens, cp, page):
    ref = reference_positions(lens, cp, page)
    assert [p.tolist() for p in in_seq_positions(lens, cp, page)] == ref
    assert in_seq_split(lens, cp, page) == [len(p) for p in ref]


# ----------------------------------------------------------------- properties
def _batches(longest: int):
    """A batch of up to 12 requests of 0..longest tokens (empty batches and empty requests included), a
    cp size and a page size: the examples of the property tests below (100 each)."""
    return given(lens=st.lists(st.integers(0, longest), max_size=12), cp=st.integers(1, 8),
                 page=st.sampled_from([1, 2, 7, 64]))


@settings(max_examples=100, deadline=None)
@_batches(2000)
def test_positions_are_a_permutation_and_restore_round_trips(lens, cp, page):
    total = sum(lens)
    pos = in_seq_positions(lens, cp, page)
    counts = in_seq_split(lens, cp, page)
    assert [p.numel() for p in pos] == counts
    cat = torch.cat(pos)
    assert torch.equal(torch.sort(cat).values, torch.arange(total, dtype=torch.int64))

    restore = in_seq_restore_index(lens, cp, page)
    assert restore.dtype == torch.int64 and restore.shape == (total,)
    x = torch.randn(total, 3)
    compact = torch.cat([x[p] for p in pos])  # what a compact all-gather of the shards gives
    assert torch.equal(compact[restore], x)


@settings(max_examples=100, deadline=None)
@given(lens=st.lists(st.integers(0, 5000), max_size=12), cp=st.integers(1, 8))
def test_page_size_one_is_the_token_split(lens, cp):
    nb = 2 * cp
    expected = [0] * cp
    for L in lens:
        for b in range(nb):
            block = L // nb + (1 if b < L % nb else 0)
            expected[min(b, nb - 1 - b)] += block
    assert in_seq_split(lens, cp, 1) == expected
    assert in_seq_split(lens, cp) == expected


@settings(max_examples=100, deadline=None)
@_batches(3000)
def test_block_boundaries_on_page_boundaries(lens, cp, page):
    starts, blens = _block_bounds(lens, cp, page)
    assert starts.shape == blens.shape == (len(lens), 2 * cp)
    offset = 0
    for i, L in enumerate(lens):
        local_start = starts[i] - offset
        local_end = local_start + blens[i]
        assert int(local_start[0]) == 0 and int(local_end[-1]) == L
        assert torch.equal(local_start[1:], local_end[:-1])  # consecutive blocks
        for e in local_end.tolist():
            assert e % page == 0 or e == L
        # page counts per block differ by at most one, larger ones first
        pages = [(int(n) + page - 1) // page for n in blens[i]]
        assert max(pages) - min(pages) <= 1 and pages == sorted(pages, reverse=True)
        offset += L


def test_block_boundaries_via_public_api_single_request():
    # one request: each rank's positions are two contiguous runs (blocks r and 2cp-1-r);
    # every run starts at a page boundary.
    for L, cp, page in [(700, 8, 64), (1000, 3, 7), (129, 4, 2), (5, 4, 64), (4096, 2, 64)]:
        for r, p in enumerate(in_seq_positions([L], cp, page)):
            p = p.tolist()
            run_starts = [v for k, v in enumerate(p) if k == 0 or p[k - 1] + 1 != v]
            assert len(run_starts) <= 2
            assert all(v % page == 0 for v in run_starts), (L, cp, page, r, run_starts)


def test_cp_size_one_owns_everything():
    lens = [5, 0, 17]
    pos = in_seq_positions(lens, 1, 4)
    assert in_seq_split(lens, 1, 4) == [22]
    assert sorted(pos[0].tolist()) == list(range(22))


def test_empty_and_zero_batches():
    for lens in ([], [0], [0, 0, 0]):
        assert in_seq_split(lens, 4, 64) == [0, 0, 0, 0]
        pos = in_seq_positions(lens, 4, 64)
        assert len(pos) == 4 and all(p.numel() == 0 and p.dtype == torch.int64 for p in pos)
        restore = in_seq_restore_index(lens, 4, 64)
        assert restore.shape == (0,) and restore.dtype == torch.int64


def test_tensor_and_list_inputs_agree():
    lens = [700, 3, 0, 1999]
    for dtype in (torch.int32, torch.int64):
        t = torch.tensor(lens, dtype=dtype)
        assert in_seq_split(t, 4, 7) == in_seq_split(lens, 4, 7)
        assert all(torch.equal(a, b) for a, b in zip(in_seq_positions(t, 4, 7), in_seq_positions(lens, 4, 7)))
        assert torch.equal(in_seq_restore_index(t, 4, 7), in_seq_restore_index(tuple(lens), 4, 7))


def test_large_batch_is_consistent():
    # Production-sized batch (64 x 32k tokens, cp 8): counts, positions and restore index agree.
    # Speed is measured by benchmarks, not asserted here.
    lens = [32768] * 64
    for page in (1, 64):
        counts = in_seq_split(lens, 8, page)
        positions = in_seq_positions(lens, 8, page)
        assert [len(p) for p in positions] == counts and sum(counts) == sum(lens)
        restore = in_seq_restore_index(lens, 8, page)
        assert torch.equal(torch.cat(positions)[restore], torch.arange(sum(lens)))


# ----------------------------------------------------------------- errors
BAD_ARGS = [
    (([-1, 4], 2, 1), "seq_lens"),
    (([3, 1.5], 2, 1), "seq_lens"),
    (([True], 2, 1), "seq_lens"),
    (("abc", 2, 1), "seq_lens"),
    ((None, 2, 1), "seq_lens"),
    ((5, 2, 1), "seq_lens"),
    ((torch.tensor([[1, 2]]), 2, 1), "seq_lens"),
    ((torch.tensor([1.0, 2.0]), 2, 1), "seq_lens"),
    ((torch.tensor([3, -2]), 2, 1), "seq_lens"),
    (([4], 0, 1), "cp_size"),
    (([4], -3, 1), "cp_size"),
    (([4], 2.0, 1), "cp_size"),
    (([4], True, 1), "cp_size"),
    (([4], "2", 1), "cp_size"),
    (([4], 2, 0), "page_size"),
    (([4], 2, 64.0), "page_size"),
    (([4], 2, None), "page_size"),
]


@pytest.mark.parametrize("fn", FUNCS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("args,name", BAD_ARGS, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD_ARGS)])
def test_bad_input_raises_value_error_naming_argument(fn, args, name):
    with pytest.raises(ValueError, match=name) as info:
        fn(*args)
    assert "expected" in str(info.value) and "got" in str(info.value)
