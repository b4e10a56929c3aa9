"""What a vLLM worker's kernels read, brought to and checked against a refit's target.

vLLM loads checkpoint tensors through the model's own loaders into runtime parameters, then
processes modules into what their kernels read: on the CPU backend a oneDNN or packed handle is
built from each linear weight (and the weight removed), so a module whose processing is not
re-run keeps computing with the weights it was built from. A tied ``lm_head`` is such a module:
it shares the embedding's parameter but no checkpoint tensor is loaded into it, so vLLM's reload
writes the shared parameter and never rebuilds the head's handle (it logs ``ParallelLMHead:
Failed to load weights``) and the engine keeps the old output layer.

:class:`RuntimeCheck` works around each load of a refit:

- **derived modules** (holding a parameter the checkpoint writes only through another module)
  are processed again once that parameter was written, as a fresh load processes them; a
  derived module whose processing cannot be run twice is refused when the check is built,
  naming its parameter;
- **verification**: every runtime parameter the load wrote is read as the kernels read it (the
  parameter itself where it holds its elements, and every CPU kernel handle built from it,
  through one-hot probes that return weight columns bit for bit) at sampled positions (every
  row of a few random columns; every element of a vector) and compared bit for bit with what the
  model's loader makes of the target's checkpoint tensors there (the write map,
  :mod:`refit_core.vllm.write_map`, recorded from that loader). A parameter left on the old
  version fails the refit (:class:`~refit_core.errors.VerificationError`).

Only a vLLM worker uses this module (it imports torch).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from refit_core.errors import RefitError, VerificationError
from refit_core.vllm.write_map import Fill, Piece, WriteMap, int_view

__all__ = ["COLUMNS", "RuntimeCheck"]

logger = logging.getLogger(__name__)

COLUMNS = 4
"""Columns sampled per matrix at each load (every row of each): a weight left on another
version differs in nearly every column, and a 1 % delta changes about one element in a hundred
of each, so a few columns of hundreds of rows find it."""

_REPROCESSABLE = frozenset({"UnquantizedEmbeddingMethod"})
"""Quantization methods whose processing only builds a kernel from the weight it keeps, so it
can run again on the loaded parameter (vLLM's unquantized embedding and LM head)."""


@dataclass(frozen=True)
class _Param:
    """One runtime parameter a checkpoint writes: the names the model knows it by, its loaded
    shape, the copies and fills that write it, the modules whose CPU kernels read it as their
    ``weight`` and the derived modules processed again once it is written."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    fills: tuple[Fill, ...]
    kernels: tuple[str, ...]
    derived: tuple[str, ...]


@dataclass
class _Expected:
    """The sampled positions of one parameter in this load and the values the target puts
    there."""

    index: list[torch.Tensor]
    flat: torch.Tensor
    values: torch.Tensor
    covered: torch.Tensor
    columns: torch.Tensor | None
    written: set[str] = field(default_factory=set)


class RuntimeCheck:
    """Around every load of one worker's model: derived modules processed again, and what its
    kernels read checked against the target.

    Args:
        model: the worker's model, loaded.
        found: its write map (:func:`~refit_core.vllm.write_map.capture_write_map`).

    Raises:
        RefitError: a parameter the checkpoint writes cannot be checked (its loader computes
            values the map cannot predict, or nothing reads it back as its kernel does), or a
            derived module's processing cannot run again; the message names the parameter.
    """

    def __init__(self, model: torch.nn.Module, found: WriteMap) -> None:
        self._model = model
        self._params: dict[str, _Param] = {}
        self._by_name: dict[str, list[tuple[str, Piece]]] = {}
        self._loads = 0
        self._expected: dict[str, _Expected] = {}
        pieces: dict[str, list[Piece]] = {}
        for group in (found.pieces, found.casts):
            for piece in (p for ps in group.values() for p in ps):
                pieces.setdefault(piece.param, []).append(piece)
        aliases: dict[int, list[str]] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(param), []).append(name)
        refused = []
        for names in aliases.values():
            written = [n for n in names if n in pieces or n in found.fills]
            if not written:
                continue
            try:
                self._add(tuple(names), written, pieces, found)
            except RefitError as exc:
                refused.append(str(exc))
        if refused:
            raise RefitError(f"refit cannot keep this model exact: {'; '.join(refused)}")

    def _add(
        self,
        names: tuple[str, ...],
        written: list[str],
        pieces: dict[str, list[Piece]],
        found: WriteMap,
    ) -> None:
        key = written[0]
        if len(written) > 1:
            raise RefitError(f"{key}: the loader writes it under {len(written)} names")
        if key in found.irregular:
            raise RefitError(f"{key}: {found.irregular[key]}")
        own = pieces.get(key, [])
        if not own:
            raise RefitError(f"{key}: the loader only fills it")
        shape = own[0].param_shape
        uncovered = found.uncovered(key, shape)
        if uncovered is not None:
            raise RefitError(f"{key}: {uncovered}")
        kernels = tuple(
            n.rpartition(".")[0]
            for n in names
            if len(shape) == 2
            and n.endswith(".weight")
            and getattr(self._model.get_submodule(n.rpartition(".")[0]), "cpu_linear", None)
            is not None
        )
        if self._param(key).numel() != math.prod(shape) and not kernels:
            raise RefitError(f"{key}: vLLM removed it and no kernel reads it back")
        derived = []
        for name in names:
            if name in written:
                continue
            module_name = name.rpartition(".")[0]
            method = getattr(self._model.get_submodule(module_name), "quant_method", None)
            if method is None:
                continue  # reads the shared parameter itself
            if type(method).__name__ not in _REPROCESSABLE:
                raise RefitError(
                    f"{name}: shares {key}, which vLLM's reload rewrites without processing "
                    f"{module_name} ({type(method).__name__}) again"
                )
            derived.append(module_name)
        fills = tuple(found.fills.get(key, []))
        self._params[key] = _Param(names, shape, tuple(own), fills, kernels, tuple(derived))
        for piece in own:
            self._by_name.setdefault(piece.name, []).append((key, piece))

    @property
    def derived(self) -> dict[str, tuple[str, ...]]:
        """Parameter -> the derived modules processed again once a load wrote it."""
        return {k: p.derived for k, p in self._params.items() if p.derived}

    def _param(self, name: str) -> torch.Tensor:
        module_name, _, attr = name.rpartition(".")
        tensor: torch.Tensor = getattr(self._model.get_submodule(module_name), attr)
        return tensor

    def begin(self) -> None:
        """A load starts: new sampled columns, nothing expected yet."""
        self._loads += 1
        self._expected = {}

    def expect(self, name: str, tensor: torch.Tensor) -> None:
        """Checkpoint tensor ``name`` of the target, as the load receives it: what it puts at
        the sampled positions of every parameter it writes (``tensor`` may be reused once this
        returns)."""
        for key, piece in self._by_name.get(name, []):
            expected = self._expected.get(key) or self._open(key)
            inside, values = piece.read_at(tensor.detach(), expected.index)
            expected.values[inside] = values.to(expected.values.dtype)
            expected.covered |= inside
            expected.written.add(name)

    def _open(self, key: str) -> _Expected:
        param = self._params[key]
        live = self._param(key)
        shape = param.shape
        columns = None
        ranges = [torch.arange(n) for n in shape]
        if len(shape) >= 2 and shape[-1] > COLUMNS:
            generator = torch.Generator().manual_seed(self._loads * 7919 + len(self._expected))
            columns = torch.randperm(shape[-1], generator=generator)[:COLUMNS].sort().values
            ranges[-1] = columns
        index = [t.reshape(-1) for t in torch.meshgrid(*ranges, indexing="ij")]
        flat = torch.zeros(index[0].numel(), dtype=torch.int64)
        for dim, positions in enumerate(index):
            flat += positions * math.prod(shape[dim + 1 :])
        values = torch.zeros(index[0].numel(), dtype=live.dtype)
        covered = torch.zeros(index[0].numel(), dtype=torch.bool)
        for fill in param.fills:
            inside = fill.dst.contains(index)
            values[inside] = fill.value
            covered |= inside
        expected = _Expected(index, flat, values, covered, columns)
        self._expected[key] = expected
        return expected

    def written(self) -> set[str]:
        """The parameters this load wrote (one of their checkpoint tensors expected)."""
        return set(self._expected)

    def finish(self) -> None:
        """The load is complete: process the derived modules of every parameter it wrote
        again, then check what the kernels read.

        Raises:
            VerificationError: a parameter the load wrote is read by the model or one of its
                kernels as other values than the target's (naming them).
        """
        for key in self._expected:
            for module_name in self._params[key].derived:
                module: Any = self._model.get_submodule(module_name)
                module.quant_method.process_weights_after_loading(module)
                logger.info("%s processed again: it shares %s", module_name, key)
        checked = len(self._expected)
        failures = [f for key, e in self._expected.items() for f in self._differences(key, e)]
        self._expected = {}
        if failures:
            raise VerificationError(
                f"{len(failures)} runtime parameters differ from the target after loading "
                f"(the model would not compute with the refit's weights): "
                + "; ".join(failures[:6])
                + (" ..." if len(failures) > 6 else "")
            )
        logger.debug("runtime check: %d parameters as the target", checked)

    def _differences(self, key: str, expected: _Expected) -> Iterable[str]:
        param = self._params[key]
        if not bool(expected.covered.all()):
            covered, sampled = int(expected.covered.sum()), expected.covered.numel()
            yield f"{key}: the load wrote {covered} of {sampled} sampled elements"
            return
        want = int_view(expected.values)
        live = self._param(key).detach()
        if live.numel() == math.prod(param.shape):
            got = live.reshape(-1)[expected.flat.to(live.device)].cpu()
            if not torch.equal(int_view(got.to(expected.values.dtype)), want):
                yield f"{key}: the parameter holds other values"
        for module_name in param.kernels:
            got = self._probe(module_name, param.shape, expected.columns)
            if not torch.equal(int_view(got.reshape(-1).to(expected.values.dtype)), want):
                yield f"{module_name}: its kernel reads other weights than {key}"

    def _probe(
        self, module_name: str, shape: tuple[int, ...], columns: torch.Tensor | None
    ) -> torch.Tensor:
        """The weight columns ``columns`` of a linear kernel as it computes with them: its
        output on one-hot inputs (each a single product by one, exact in any precision),
        shaped as the weight's rows by the columns."""
        module: Any = self._model.get_submodule(module_name)
        weight = self._param(f"{module_name}.weight")
        picked = torch.arange(shape[-1]) if columns is None else columns
        onehot = torch.zeros(picked.numel(), shape[-1], dtype=weight.dtype, device=weight.device)
        onehot[torch.arange(picked.numel()), picked] = 1
        with torch.no_grad():
            out: torch.Tensor = module.cpu_linear(onehot, weight, None)
        return out.t().contiguous().cpu()
