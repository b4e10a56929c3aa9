"""The runtime check of the vLLM receivers, without vLLM: a model shaped as vLLM's CPU backend
leaves it (linear kernels built from each weight at processing, the weight then removed; a tied
head sharing the embedding's parameter, never loaded itself), reloaded as vLLM's layerwise
reload does (every loaded module processed again, the tied head not).

vLLM's own models go through it in the engine tier (``tests/engine/``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pytest
import torch
from torch import nn

from refit_core import RefitError, VerificationError
from refit_core.vllm.runtime_check import RuntimeCheck
from refit_core.vllm.write_map import WriteMap, record_writes

SHAPES = {"embed": (10, 8), "q": (4, 8), "k": (2, 8), "norm": (8,)}


class _Method:
    """Processing as vLLM's CPU backend does it: a kernel built from a copy of the weight
    (the weight removed after, for linears)."""

    removes_weight = False

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        handle = layer.weight.detach().clone()
        layer.cpu_linear = lambda x, weight, bias: nn.functional.linear(x, handle, bias)
        if self.removes_weight:
            layer.weight = nn.Parameter(torch.empty(0, dtype=handle.dtype), requires_grad=False)


class UnquantizedEmbeddingMethod(_Method):
    """Named as vLLM's: its processing may run again on the weight it keeps."""


class UnquantizedLinearMethod(_Method):
    removes_weight = True


class PackedMethod(_Method):
    """A processing refit does not know how to run twice."""


class _Layer(nn.Module):
    def __init__(self, rows: int, cols: int, method: _Method) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, cols, dtype=torch.bfloat16))
        self.quant_method = method


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))


class _Model(nn.Module):
    """An embedding padded from 10 to 12 rows, q and k fused into one linear, a norm and,
    when ``tied``, a head sharing the embedding's parameter."""

    def __init__(
        self, *, tied: bool = True, head_method: type[_Method] = UnquantizedEmbeddingMethod
    ):
        super().__init__()
        self.embed = _Layer(12, 8, UnquantizedEmbeddingMethod())
        self.qk = _Layer(6, 8, UnquantizedLinearMethod())
        self.norm = _Norm()
        self.head = _Layer(12, 8, head_method())
        if tied:
            self.head.weight = self.embed.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name == "embed":
                self.embed.weight.data[:10].copy_(w)
                self.embed.weight.data[10:].fill_(0)
            elif name == "q":
                self.qk.weight.data[:4].copy_(w)
            elif name == "k":
                self.qk.weight.data[4:].copy_(w)
            elif name == "norm":
                self.norm.weight.data.copy_(w)

    def reload(
        self,
        weights: Mapping[str, torch.Tensor],
        skip: frozenset[str] = frozenset(),
        tamper: Callable[[_Model], None] | None = None,
    ) -> None:
        """vLLM's layerwise reload: the linear's weight back in its loaded shape, every loaded
        module processed again (but those in ``skip``; ``tamper`` runs between loading and
        processing); the tied head is never loaded."""
        self.qk.weight = nn.Parameter(torch.zeros(6, 8, dtype=torch.bfloat16), requires_grad=False)
        self.load_weights(weights.items())
        if tamper is not None:
            tamper(self)
        for name in ("embed", "qk"):
            if name not in skip:
                layer = getattr(self, name)
                layer.quant_method.process_weights_after_loading(layer)

    def fresh(self, weights: Mapping[str, torch.Tensor]) -> None:
        """A fresh load: every module processed, the head included."""
        self.reload(weights)
        self.head.quant_method.process_weights_after_loading(self.head)


def _state(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=generator).to(torch.bfloat16) for n, s in SHAPES.items()}


def _write_map() -> WriteMap:
    """Recorded as vLLM's capture does: every layer in its loaded shapes, none tied."""
    restored = _Model(tied=False)
    weights = {n: torch.empty(s, dtype=torch.bfloat16, device="meta") for n, s in SHAPES.items()}
    return record_writes(
        dict(restored.named_parameters(remove_duplicate=False)), weights, restored.load_weights
    )


def _head_output(model: _Model) -> torch.Tensor:
    x = torch.ones(1, 8, dtype=torch.bfloat16)
    return model.head.cpu_linear(x, model.head.weight, None)


def _expected_head(state: Mapping[str, torch.Tensor]) -> torch.Tensor:
    reference = _Model()
    reference.fresh(state)
    return _head_output(reference)


def _bucket(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state``'s tensors as a transfer hands them over: views of one packed buffer."""
    packed = torch.cat([t.reshape(-1) for t in state.values()])
    views, start = {}, 0
    for name, tensor in state.items():
        views[name] = packed[start : start + tensor.numel()].view(tensor.shape)
        start += tensor.numel()
    return views


def _refit(
    model: _Model, check: RuntimeCheck, state: Mapping[str, torch.Tensor], **reload: Any
) -> None:
    check.begin()
    for name, tensor in _bucket(state).items():
        check.expect(name, tensor)
    model.reload(state, **reload)
    check.finish()


@pytest.fixture
def model() -> _Model:
    fresh = _Model()
    fresh.fresh(_state(1))
    return fresh


def test_the_tied_head_is_processed_again_and_every_kernel_is_checked(model: _Model) -> None:
    check = RuntimeCheck(model, _write_map())
    assert check.derived == {"embed.weight": ("head",)}
    target = _state(2)
    _refit(model, check, target)
    assert torch.equal(_head_output(model), _expected_head(target)), "the head computes with B"


def test_without_processing_the_head_again_the_reload_leaves_it_on_the_old_weights(
    model: _Model,
) -> None:
    target = _state(2)
    model.reload(target)
    assert not torch.equal(_head_output(model), _expected_head(target))
    assert torch.equal(model.head.weight, model.embed.weight), "the shared parameter is new"


def test_a_module_the_load_did_not_process_fails_it(model: _Model) -> None:
    check = RuntimeCheck(model, _write_map())
    with pytest.raises(VerificationError, match=r"qk\.weight: vLLM did not process qk"):
        _refit(model, check, _state(2), skip=frozenset({"qk"}))


def test_a_kernel_left_on_the_old_version_fails_the_load(model: _Model) -> None:
    check = RuntimeCheck(model, _write_map())
    old = model.qk.cpu_linear

    def keep_the_kernel(tampered: _Model) -> None:
        process = tampered.qk.quant_method.process_weights_after_loading

        def keeping(layer: nn.Module) -> None:
            process(layer)
            layer.cpu_linear = old

        tampered.qk.quant_method.process_weights_after_loading = keeping  # type: ignore[method-assign]

    with pytest.raises(
        VerificationError, match=r"qk: its kernel reads other weights than qk\.weight"
    ):
        _refit(model, check, _state(2), tamper=keep_the_kernel)


@pytest.mark.parametrize(
    ("param", "failure"),
    [
        ("embed", r"embed\.weight: the parameter holds other values than embed"),
        ("qk", r"qk\.weight: the parameter holds other values than k"),
    ],
    ids=["kept", "removed once its kernel is built"],
)
def test_a_parameter_one_element_of_which_stays_old_fails_the_load(
    model: _Model, param: str, failure: str
) -> None:
    """One element of millions would escape sampled positions; the digests cover them all."""
    check = RuntimeCheck(model, _write_map())
    old = {"embed": model.embed.weight[9, 7].item(), "qk": _state(1)["k"][1, 7].item()}

    def one_old_element(tampered: _Model) -> None:
        getattr(tampered, param).weight.data[9 if param == "embed" else 5, 7] = old[param]

    with pytest.raises(VerificationError, match=failure):
        _refit(model, check, _state(2), tamper=one_old_element)


def test_a_parameter_the_load_skipped_fails_it(model: _Model) -> None:
    check = RuntimeCheck(model, _write_map())
    target = _state(2)
    check.begin()
    for name, tensor in target.items():
        check.expect(name, tensor)
    model.reload({n: t for n, t in target.items() if n != "norm"})
    with pytest.raises(VerificationError, match=r"norm\.weight: the parameter holds other values"):
        check.finish()


def test_a_load_that_writes_part_of_a_parameter_fails(model: _Model) -> None:
    check = RuntimeCheck(model, _write_map())
    target = _state(2)
    check.begin()
    check.expect("q", target["q"])  # k never comes
    model.reload(target)
    with pytest.raises(VerificationError, match=r"qk\.weight: the load never received k"):
        check.finish()


def test_a_tied_module_whose_processing_cannot_run_again_is_refused_naming_it() -> None:
    model = _Model(head_method=PackedMethod)
    model.fresh(_state(1))
    with pytest.raises(RefitError, match=r"head\.weight: shares embed\.weight.*PackedMethod"):
        RuntimeCheck(model, _write_map())


def test_an_untied_model_has_no_derived_module() -> None:
    model = _Model(tied=False)
    model.fresh(_state(1))
    assert RuntimeCheck(model, _write_map()).derived == {}
