"""`torch.bincount` given its length, counted on the device while a capture runs (backends/sync_free.py):
the same integers as torch's, the check that stops a value outside the bins, and torch's own everywhere
else. Whether a CUDA capture then holds it (no break in transformers 5.17's load-balancing loss) is
tests/gpu/test_moe_gpu.py's."""

from __future__ import annotations

import pytest
import torch

from graphstep.backends import sync_free


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_counts_equal_torchs_bincount(dtype):
    g = torch.Generator().manual_seed(0)
    for n, bins in [(0, 3), (1, 1), (37, 8), (2048, 64), (50, 300)]:
        high = min(bins, 256) if dtype is torch.uint8 else bins
        values = torch.randint(0, high, (n,), generator=g).to(dtype)
        want = torch.bincount(values, minlength=bins)
        got = sync_free.counted_on_device(values, bins)
        assert got.dtype == want.dtype and torch.equal(got, want), (n, bins)


@pytest.mark.parametrize("outside", [8, -1])
def test_a_value_outside_the_bins_is_stopped_not_dropped(outside):
    values = torch.tensor([0, 3, outside, 7])
    with pytest.raises(RuntimeError, match="outside"):  # on the CPU the assert raises at once
        sync_free.counted_on_device(values, 8)


def test_bincount_is_torchs_own_outside_a_cuda_capture_and_put_back_after():
    values = torch.tensor([1, 1, 5])
    with sync_free.counts_on_device():
        assert torch.bincount is not sync_free._original
        assert torch.equal(torch.bincount(values, minlength=3), torch.tensor([0, 2, 0, 0, 0, 1]))  # longer
        assert torch.equal(torch.bincount(values), torch.tensor([0, 2, 0, 0, 0, 1]))
        w = torch.tensor([0.5, 0.25, 1.0])
        assert torch.equal(
            torch.bincount(values, w, 2), torch.tensor([0.0, 0.75, 0, 0, 0, 1.0], dtype=w.dtype)
        )
    assert torch.bincount is sync_free._original


def test_one_function_stands_in_for_bincount_in_every_warm_up_and_capture():
    """torch.compile guards on the functions a compiled model met: the warm-ups and the capture must hand it
    the same one, made with compiling off once torch.compile is in use (a compiled model then calls it as
    it is instead of compiling it at capture, which graphstep refuses)."""
    import torch._dynamo  # torch.compile in use

    seen = []
    for _ in range(3):
        with sync_free.counts_on_device():
            seen.append(torch.bincount)
    assert seen[0] is seen[1] is seen[2] and seen[0] is not sync_free._bincount
