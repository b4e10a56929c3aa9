"""Row-major spans of strided tensors, and the block-wise digest built on them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from refit_lab.digest import tensor_digest as trainer_digest
from refit_zmq.codec import digest, tensor_digest
from refit_zmq.codec.spans import read_span, span_views


@st.composite
def _strided(draw: st.DrawFn) -> torch.Tensor:
    """A tensor of up to 4 dimensions, possibly permuted, sliced or stepped."""
    shape = draw(st.lists(st.integers(1, 5), min_size=0, max_size=4))
    doubled = [2 * d for d in shape]
    base = torch.arange(int(torch.tensor(doubled, dtype=torch.int64).prod()), dtype=torch.int32)
    tensor = base.reshape(*doubled) if shape else base.reshape(())
    if shape:
        tensor = tensor[
            tuple(slice(draw(st.integers(0, d)), None, draw(st.integers(1, 2))) for d in shape)
        ]
        tensor = tensor.permute(*draw(st.permutations(range(len(shape)))))
    return tensor


@given(tensor=_strided(), data=st.data())
def test_a_span_holds_exactly_the_row_major_elements(
    tensor: torch.Tensor, data: st.DataObject
) -> None:
    numel = tensor.numel()
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    want = tensor.reshape(-1)[start:stop]
    views = span_views(tensor, start, stop)
    assert len(views) <= max(1, 2 * tensor.dim() - 1)
    got = torch.cat([v.reshape(-1) for v in views]) if views else want[:0]
    assert torch.equal(got, want)
    assert torch.equal(read_span(tensor, start, stop), want)
    out = torch.full((stop - start,), -1, dtype=tensor.dtype)
    assert read_span(tensor, start, stop, out=out) is out
    assert torch.equal(out, want)


def test_a_contiguous_span_is_a_view_not_a_copy() -> None:
    tensor = torch.arange(100)
    span = read_span(tensor, 10, 20)
    assert span.data_ptr() == tensor[10:].data_ptr()


def test_a_span_outside_the_tensor_is_refused() -> None:
    with pytest.raises(ValueError, match="outside"):
        span_views(torch.zeros(3, 4), 5, 13)


@pytest.mark.parametrize("block_bytes", [64, 1000, 1 << 20])
def test_digest_of_strided_tensors_through_blocks_matches_the_trainer(
    block_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(digest, "DIGEST_BLOCK_BYTES", block_bytes)
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(40, 70, generator=gen).to(torch.bfloat16)
    for tensor in (base, base.t(), base[3:, 5:60:2], base[0, 0]):
        assert tensor_digest(tensor) == trainer_digest(tensor)


@pytest.mark.gpu
def test_digest_of_gpu_tensors_block_by_block_matches_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(digest, "DIGEST_BLOCK_BYTES", 4096)
    base = torch.randn(300, 70, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for tensor in (base, base.t(), base[3:, 5:60:2]):
        assert tensor_digest(tensor.to("cuda")) == trainer_digest(tensor)
