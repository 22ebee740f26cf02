"""nsa_cp.api.moe.mask_padding_topk_ids on CPU: padding rows -> -1, real rows untouched, errors write nothing."""

import pytest
import torch

from nsa_cp import ShardLayout
from nsa_cp.api.moe import mask_padding_topk_ids

LAYOUTS = [
    ([5, 3], 1),
    ([4, 0, 2], 1),      # a zero-token rank
    ([0, 0], 1),         # empty
    ([4, 4, 4], 1),      # even: nothing to mask
    ([7, 6], 4),         # align pads past the largest count (SGLang's 2 * cp_size)
    ([1, 9, 3, 9], 1),
]


def _expected(ids: torch.Tensor, counts, m) -> torch.Tensor:
    want = ids.clone()
    for r, n in enumerate(counts):
        want[r * m + n : (r + 1) * m] = -1
    return want


def _random_ids(rows, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (rows, k), generator=g).to(dtype)


@pytest.mark.parametrize("counts,align", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_padded_rows_masked(counts, align, dtype):
    layout = ShardLayout(counts, align=align)
    ids = _random_ids(layout.padded_len, 8, dtype)
    want = _expected(ids, counts, layout.max_rank_len)
    out = mask_padding_topk_ids(ids, layout)
    assert out is ids
    assert torch.equal(ids, want)
    if layout.padding_rows:
        assert bool((ids == -1).any())


@pytest.mark.parametrize("counts,align", LAYOUTS)
def test_device_counts_read_on_device(counts, align):
    # the layout is the bucket; the real counts (smaller) come from the device tensors only
    m = -(-(max(counts) + 2) // align) * align
    bucket = ShardLayout([m] * len(counts), align=align)
    real = torch.tensor(counts, dtype=torch.int32)
    offsets = torch.cumsum(real, 0, dtype=torch.int32) - real
    ids = _random_ids(bucket.padded_len, 4, torch.int64, seed=1)
    want = _expected(ids, counts, bucket.max_rank_len)
    mask_padding_topk_ids(ids, bucket, device_counts=(real, offsets))
    assert torch.equal(ids, want)
    # the bucket itself is even: without device_counts nothing would be masked
    again = _random_ids(bucket.padded_len, 4, torch.int64, seed=1)
    assert torch.equal(mask_padding_topk_ids(again.clone(), bucket), again)


def test_compact_shape_is_a_no_op():
    layout = ShardLayout([5, 3])
    ids = _random_ids(layout.total_len, 8, torch.int32)
    before = ids.clone()
    assert mask_padding_topk_ids(ids, layout) is ids
    assert torch.equal(ids, before)


def test_non_contiguous_view_masked_in_place():
    layout = ShardLayout([3, 1])
    base = _random_ids(layout.padded_len, 16, torch.int64)
    view = base[:, ::2]
    want = _expected(view, [3, 1], 3)
    mask_padding_topk_ids(view, layout)
    assert torch.equal(view, want)
    assert torch.equal(base[:, ::2], want)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: torch.zeros(9, 8, dtype=torch.int32), r"topk_ids: expected shape \[10, 8\].*\[8, 8\].*got \[9, 8\]"),
        (lambda: torch.zeros(10, dtype=torch.int32), r"topk_ids: expected a 2-D tensor \[10, top_k\].*got shape \[10\]"),
        (lambda: torch.zeros(10, 8, dtype=torch.float32), r"topk_ids: expected a signed integer dtype.*float32"),
        (lambda: torch.zeros(10, 8, dtype=torch.uint8), r"topk_ids: expected a signed integer dtype.*uint8"),
    ],
)
def test_bad_topk_ids(make, match):
    layout = ShardLayout([5, 3])  # padded 10, compact 8
    ids = make()
    before = ids.clone()
    with pytest.raises(ValueError, match=match):
        mask_padding_topk_ids(ids, layout)
    assert torch.equal(ids, before)


def test_bad_device_counts_write_nothing():
    layout = ShardLayout([5, 5])
    ids = _random_ids(10, 4, torch.int64)
    before = ids.clone()
    good = torch.tensor([5, 3], dtype=torch.int32)
    off = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"device_counts\[0\]: expected int32 \[2\]"):
        mask_padding_topk_ids(ids, layout, device_counts=(good.long(), off))
    with pytest.raises(ValueError, match=r"device_counts\[1\]: expected int32 \[2\] on cpu, got torch.int32 \[3\]"):
        mask_padding_topk_ids(ids, layout, device_counts=(good, torch.zeros(3, dtype=torch.int32)))
    with pytest.raises(ValueError, match="device_counts: expected a \\(counts, offsets\\) pair"):
        mask_padding_topk_ids(ids, layout, device_counts=good)
    with pytest.raises(ValueError, match=r"topk_ids: expected shape \[10, 4\] \(the padded bucket"):
        mask_padding_topk_ids(ids[:8], ShardLayout([5, 5]), device_counts=(good, off))
    with pytest.raises(ValueError, match="layout: expected an nsa_cp.ShardLayout"):
        mask_padding_topk_ids(ids, [5, 5])
    assert torch.equal(ids, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (capture-safety of device_counts)")
def test_cuda_graph_capture_with_device_counts():
    bucket = ShardLayout([8, 8])
    counts = torch.tensor([8, 8], dtype=torch.int32, device="cuda")
    offsets = torch.tensor([0, 8], dtype=torch.int32, device="cuda")
    ids = torch.zeros(16, 4, dtype=torch.int64, device="cuda")
    src = torch.randint(0, 64, (16, 4), device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture
        ids.copy_(src)
        mask_padding_topk_ids(ids, bucket, device_counts=(counts, offsets))
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids.copy_(src)
        mask_padding_topk_ids(ids, bucket, device_counts=(counts, offsets))
    for real in ([5, 3], [0, 8], [8, 1]):  # odd number of replays
        counts.copy_(torch.tensor(real, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ids.cpu(), _expected(src.cpu(), real, 8))
