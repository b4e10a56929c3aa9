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
- **digests of every parameter the load writes**: each checkpoint tensor of the target, as the
  load receives it, is digested box by box where the model's loader puts it (the write map,
  :mod:`refit_core.vllm.write_map`, recorded from that loader: a fresh load's layout), and the
  same boxes of the runtime parameter are digested once it is loaded (xxh3 of every element's
  bits: about 0.1 s per GB each side). A parameter vLLM removes after building its kernel (the
  CPU backend's linear weights) is digested as its module's processing starts, from the weight
  the kernel is then built from; one whose module was not processed in the load fails, since
  its kernel keeps the weights it was built from;
- **the kernels**: every CPU kernel handle built from a written parameter is read through
  one-hot probes (each output one weight times one, exact in any precision) at every row of a
  few random columns and compared bit for bit with the target there. A kernel is built from its
  whole parameter, so one left on another version differs in nearly every column (a 1 % delta:
  about one element in a hundred of each).

A parameter left on the old version, wholly or in part, fails the refit
(:class:`~refit_core.errors.VerificationError`).

Only a vLLM worker uses this module (it imports torch and xxhash, which the ``vllm`` extra
installs).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from refit_core.errors import RefitError, VerificationError
from refit_core.extras import missing_extra

try:  # the `vllm` extra installs them
    import torch
    import xxhash
except ModuleNotFoundError as missing:
    raise missing_extra(__name__, missing, "vllm") from missing

from refit_core.vllm.write_map import Fill, Piece, WriteMap, int_view

__all__ = ["COLUMNS", "RuntimeCheck", "bits_digest"]

logger = logging.getLogger(__name__)

COLUMNS = 4
"""Columns of each kernel probed at each load (every row of each)."""

_REPROCESSABLE = frozenset({"UnquantizedEmbeddingMethod"})
"""Quantization methods whose processing only builds a kernel from the weight it keeps, so it
can run again on the loaded parameter (vLLM's unquantized embedding and LM head)."""


def bits_digest(tensor: torch.Tensor) -> int:
    """xxh3-64 of ``tensor``'s element bits in row-major order (a strided view, or one off
    the host, is copied to a contiguous host tensor first)."""
    bits = int_view(tensor.detach()).contiguous().reshape(-1).cpu()
    return int(xxhash.xxh3_64_intdigest(bits.numpy().view("u1").data))


@dataclass(frozen=True)
class _Param:
    """One runtime parameter a checkpoint writes: the names the model knows it by, its loaded
    shape, the dtype it holds, the copies and fills that write it, the modules whose CPU
    kernels read it as their ``weight``, the derived modules processed again once it is
    written, and whether vLLM removes it once its kernel is built."""

    names: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]
    fills: tuple[Fill, ...]
    kernels: tuple[str, ...]
    derived: tuple[str, ...]
    removed: bool

    def held(self, tensor: torch.Tensor) -> tuple[list[int], bool]:
        """Digests of the boxes the pieces write in ``tensor`` (this parameter, loaded), and
        whether its padding holds the fills."""
        flat = tensor.detach().reshape(-1)
        digests = [bits_digest(p.target_view(flat).to(self.dtype)) for p in self.pieces]
        return digests, all(fill.holds(flat, self.shape) for fill in self.fills)


@dataclass
class _Probe:
    """Sampled positions of a parameter (every row of a few columns) and the values the
    target puts there, for its kernels' probes."""

    index: list[torch.Tensor]
    values: torch.Tensor
    columns: torch.Tensor | None


@dataclass
class _Expected:
    """What one load's target puts in one parameter: the digest of each piece's box (by the
    piece's position) and, for a parameter kernels read, the probed values."""

    digests: dict[int, int] = field(default_factory=dict)
    probe: _Probe | None = None


class RuntimeCheck:
    """Around every load of one worker's model: derived modules processed again, and every
    parameter it writes and what its kernels read checked against the target.

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
        self._by_name: dict[str, list[tuple[str, int, Piece]]] = {}
        self._loads = 0
        self._loading = False
        self._expected: dict[str, _Expected] = {}
        self._processed: dict[str, tuple[list[int], bool]] = {}
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
        for key, written_param in self._params.items():
            if written_param.removed:
                self._watch_processing(key)

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
        live = self._param(key)
        removed = live.numel() != math.prod(shape)
        if removed and not kernels:
            raise RefitError(f"{key}: vLLM removed it and no kernel reads it back")
        if removed and getattr(self._owner(key), "quant_method", None) is None:
            raise RefitError(f"{key}: vLLM removed it and no processing builds its kernel")
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
        self._params[key] = _Param(
            names, shape, live.dtype, tuple(own), fills, kernels, tuple(derived), removed
        )
        for position, piece in enumerate(own):
            self._by_name.setdefault(piece.name, []).append((key, position, piece))

    def _owner(self, key: str) -> Any:
        return self._model.get_submodule(key.rpartition(".")[0])

    def _watch_processing(self, key: str) -> None:
        """Digest ``key`` (a parameter vLLM removes once its kernel is built) whenever its
        module is processed during a load, before the processing removes it."""
        module = self._owner(key)
        method = module.quant_method
        process: Callable[[Any], None] = method.process_weights_after_loading
        attr = key.rpartition(".")[2]
        param = self._params[key]

        def processing(layer: Any) -> None:
            if self._loading and layer is module:
                self._processed[key] = param.held(getattr(layer, attr))
            process(layer)

        method.process_weights_after_loading = processing

    @property
    def derived(self) -> dict[str, tuple[str, ...]]:
        """Parameter -> the derived modules processed again once a load wrote it."""
        return {k: p.derived for k, p in self._params.items() if p.derived}

    def _param(self, name: str) -> torch.Tensor:
        module_name, _, attr = name.rpartition(".")
        tensor: torch.Tensor = getattr(self._model.get_submodule(module_name), attr)
        return tensor

    def begin(self) -> None:
        """A load starts: new probed columns, nothing expected yet."""
        self._loads += 1
        self._loading = True
        self._expected = {}
        self._processed = {}

    def expect(self, name: str, tensor: torch.Tensor) -> None:
        """Checkpoint tensor ``name`` of the target, as the load receives it: the digest of
        every box it puts in a parameter, and its values at the probed positions
        (``tensor`` may be reused once this returns)."""
        source = tensor.detach()
        for key, position, piece in self._by_name.get(name, []):
            expected = self._expected.get(key) or self._open(key)
            dtype = self._params[key].dtype
            expected.digests[position] = bits_digest(piece.source_view(source).to(dtype))
            probe = expected.probe
            if probe is not None:
                inside, values = piece.read_at(source, probe.index)
                probe.values[inside] = values.to(dtype)

    def _open(self, key: str) -> _Expected:
        param = self._params[key]
        expected = _Expected()
        self._expected[key] = expected
        if not param.kernels:
            return expected
        shape = param.shape
        columns = None
        ranges = [torch.arange(n) for n in shape]
        if shape[-1] > COLUMNS:
            generator = torch.Generator().manual_seed(self._loads * 7919 + len(self._expected))
            columns = torch.randperm(shape[-1], generator=generator)[:COLUMNS].sort().values
            ranges[-1] = columns
        index = [t.reshape(-1) for t in torch.meshgrid(*ranges, indexing="ij")]
        values = torch.zeros(index[0].numel(), dtype=param.dtype)
        for fill in param.fills:
            values[fill.dst.contains(index)] = fill.value
        expected.probe = _Probe(index, values, columns)
        return expected

    def written(self) -> set[str]:
        """The parameters this load wrote (one of their checkpoint tensors expected)."""
        return set(self._expected)

    def finish(self) -> None:
        """The load is complete: process the derived modules of every parameter it wrote
        again, then check every parameter it wrote and what the kernels read.

        Raises:
            VerificationError: a parameter the load wrote holds, or is read by one of its
                kernels as, other values than the target's (naming them).
        """
        self._loading = False
        for key in self._expected:
            for module_name in self._params[key].derived:
                module: Any = self._model.get_submodule(module_name)
                module.quant_method.process_weights_after_loading(module)
                logger.info("%s processed again: it shares %s", module_name, key)
        checked = len(self._expected)
        failures = [f for key, e in self._expected.items() for f in self._differences(key, e)]
        self._expected = {}
        self._processed = {}
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
        missing = {p.name for i, p in enumerate(param.pieces) if i not in expected.digests}
        if missing:
            yield f"{key}: the load never received {', '.join(sorted(missing))}"
            return
        if param.removed:
            held = self._processed.get(key)
            if held is None:
                yield (
                    f"{key}: vLLM did not process {key.rpartition('.')[0]} in this load (its "
                    f"kernel keeps the weights it was built from)"
                )
                return
        else:
            held = param.held(self._param(key))
        digests, fills_hold = held
        if not fills_hold:
            yield f"{key}: its padding holds other values"
        wrong = {p.name for i, p in enumerate(param.pieces) if digests[i] != expected.digests[i]}
        if wrong:
            yield f"{key}: the parameter holds other values than {', '.join(sorted(wrong))}"
        probe = expected.probe
        if probe is None:
            return
        want = int_view(probe.values)
        for module_name in param.kernels:
            got = self._probe(module_name, param.shape, probe.columns)
            if not torch.equal(int_view(got.reshape(-1).to(param.dtype)), want):
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
