"""Tests of refit_lab.digest: bitwise, layout-independent, dtype- and shape-sensitive."""

from __future__ import annotations

import pytest
import torch

from refit_lab.digest import combined_digest, state_digest, tensor_digest


def _bf16(seed: int = 0, shape: tuple[int, ...] = (8, 16)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator).to(torch.bfloat16)


def test_equal_tensors_equal_digest() -> None:
    assert tensor_digest(_bf16()) == tensor_digest(_bf16().clone())


def test_one_flipped_bit_in_bf16_changes_digest() -> None:
    tensor = _bf16()
    flipped = tensor.clone()
    bits = flipped.view(torch.int16)
    bits[3, 5] ^= 1
    assert not torch.equal(tensor.view(torch.int16), flipped.view(torch.int16))
    assert tensor_digest(tensor) != tensor_digest(flipped)


def test_negative_zero_differs_from_zero() -> None:
    zero = torch.zeros(4, dtype=torch.float32)
    negative_zero = -zero
    assert torch.equal(zero, negative_zero)  # numerically equal, bitwise not
    assert tensor_digest(zero) != tensor_digest(negative_zero)


def test_nan_payloads_differ() -> None:
    quiet = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    payload = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert torch.isnan(quiet).all()
    assert torch.isnan(payload).all()
    assert tensor_digest(quiet) != tensor_digest(payload)


def test_non_contiguous_equals_contiguous_copy() -> None:
    base = _bf16(shape=(16, 12))
    transposed = base.t()
    strided = base[::2, 1::3]
    assert not transposed.is_contiguous()
    assert not strided.is_contiguous()
    assert tensor_digest(transposed) == tensor_digest(transposed.contiguous())
    assert tensor_digest(strided) == tensor_digest(strided.contiguous())


def test_storage_offset_view_hashes_only_its_elements() -> None:
    base = _bf16(shape=(4, 8))
    assert tensor_digest(base[2:]) == tensor_digest(base[2:].clone())
    assert tensor_digest(base[2:]) != tensor_digest(base)


def test_shape_and_dtype_are_part_of_the_digest() -> None:
    tensor = _bf16(shape=(8, 16))
    assert tensor_digest(tensor) != tensor_digest(tensor.reshape(16, 8))
    assert tensor_digest(tensor) != tensor_digest(tensor.reshape(-1))
    assert tensor_digest(tensor) != tensor_digest(tensor.view(torch.int16))


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.int8,
        torch.int64,
        torch.uint8,
        torch.bool,
    ],
)
def test_dtypes_are_supported_and_value_sensitive(dtype: torch.dtype) -> None:
    tensor = torch.zeros(3, 5, dtype=dtype)
    changed = tensor.clone()
    changed[1, 2] = 1
    assert tensor_digest(tensor) == tensor_digest(tensor.clone())
    assert tensor_digest(tensor) != tensor_digest(changed)


def test_scalar_and_empty_tensors() -> None:
    assert tensor_digest(torch.tensor(1.0)) != tensor_digest(torch.tensor([1.0]))
    assert tensor_digest(torch.empty(0, 4)) != tensor_digest(torch.empty(4, 0))


def test_requires_grad_tensor() -> None:
    tensor = torch.ones(3, requires_grad=True)
    assert tensor_digest(tensor) == tensor_digest(torch.ones(3))


def test_state_digest_is_per_name() -> None:
    a, b = _bf16(1), _bf16(2)
    digests = state_digest([("a", a), ("b", b)])
    assert digests == {"a": tensor_digest(a), "b": tensor_digest(b)}


def test_state_digest_rejects_duplicate_names() -> None:
    with pytest.raises(ValueError, match="'a'"):
        state_digest([("a", _bf16(1)), ("a", _bf16(2))])


def test_combined_digest_is_order_independent_and_sensitive() -> None:
    digests = {"a": 1, "b": 2, "c": 3}
    reordered = {"c": 3, "a": 1, "b": 2}
    combined = combined_digest(digests)
    assert isinstance(combined, str)
    assert len(combined) == 32
    int(combined, 16)
    assert combined == combined_digest(reordered)
    assert combined != combined_digest({"a": 1, "b": 2, "c": 4})
    assert combined != combined_digest({"a": 1, "b": 2, "d": 3})
    assert combined != combined_digest({"a": 1, "b": 2})
    assert combined != combined_digest({"a": 2, "b": 1, "c": 3})


def test_combined_digest_names_are_not_ambiguous() -> None:
    assert combined_digest({"ab": 1, "c": 2}) != combined_digest({"a": 1, "bc": 2})
