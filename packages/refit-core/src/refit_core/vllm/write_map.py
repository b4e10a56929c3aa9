"""Where each checkpoint element lands in a vLLM worker's runtime parameters.

vLLM's loaders (``load_weights`` and each parameter's ``weight_loader``) rename checkpoint
tensors, fuse them (``q_proj`` + ``k_proj`` + ``v_proj`` into ``qkv_proj``), slice them for
the worker's tensor-parallel rank and pad them; for unquantized weights on a GPU the last step
is a plain ``copy_`` of a box of the checkpoint tensor (``narrow`` along some dims) into a box
of a parameter. :func:`capture_write_map` records those copies once per worker by running the
model's own ``load_weights`` on meta tensors shaped like the checkpoint, with every layer
restored to its checkpoint-time shapes on meta (vLLM's reload metadata) and every write into a
parameter intercepted (``TorchDispatchMode``) and recorded instead of made: no value is read
or written and no memory is used. A write that is not a same-dtype copy of a box of a
checkpoint tensor into a box of a parameter (a computed tensor, a cast, a reshape that crosses
dims) marks its parameter irregular; constant fills (padding) are recorded as such.

:meth:`WriteMap.verify` then checks every regular parameter by a round trip against the
checkpoint the model was loaded from: its boxes exactly cover it, and reading the checkpoint's
elements back from the runtime storage through the map (and through the same index arithmetic
a delta's writes use, on a sample) gives their bits.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from refit_core.extras import missing_extra

try:  # the `vllm` extra installs torch
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
except ModuleNotFoundError as missing:
    raise missing_extra(__name__, missing, "vllm") from missing

__all__ = [
    "Fill",
    "Piece",
    "WriteMap",
    "capture_write_map",
    "int_view",
    "record_writes",
    "unravel",
]

logger = logging.getLogger(__name__)

_SAMPLE = 64
"""Elements per piece checked through :meth:`Piece.select` at verification."""


_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def int_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bits as the integer dtype of the same width (no copy)."""
    return tensor.view(_INT_OF_WIDTH[tensor.element_size()])


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    return tuple(strides)


def unravel(flat: torch.Tensor, shape: tuple[int, ...]) -> list[torch.Tensor]:
    """Row-major multi-indices (one int64 tensor per dim) of ``flat`` indices into ``shape``."""
    index = []
    rest = flat
    for size in reversed(shape):
        index.append(rest % size)
        rest = rest // size
    return index[::-1]


@dataclass(frozen=True)
class _Box:
    """A box of a contiguous tensor: start and length per dim."""

    start: tuple[int, ...]
    length: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.length)

    def contains(self, index: Sequence[torch.Tensor]) -> torch.Tensor:
        """Which of the positions ``index`` (one int64 tensor per dim) lie in the box."""
        inside = torch.ones_like(index[0], dtype=torch.bool)
        for t, start, length in zip(index, self.start, self.length, strict=True):
            inside &= (t >= start) & (t < start + length)
        return inside

    def overlaps(self, other: _Box) -> bool:
        return all(
            a < b + m and b < a + n
            for a, n, b, m in zip(self.start, self.length, other.start, other.length, strict=True)
        )


def _box_of(
    view: torch.Tensor, base_offset: int, shape: tuple[int, ...]
) -> tuple[_Box, list[int]] | None:
    """The box of a contiguous tensor of ``shape`` (storage offset ``base_offset``) that
    ``view`` covers, and the base dim each view dim of size > 1 runs along; None when the view
    is not such a box (a reshape across dims, a stride that skips elements)."""
    strides = _contiguous_strides(shape)
    offset = int(view.storage_offset()) - base_offset
    start: list[int] = []
    for size, stride in zip(shape, strides, strict=True):
        start.append((offset // stride) % size if size > 1 else 0)
    if offset < 0 or sum(s * c for s, c in zip(start, strides, strict=True)) != offset:
        return None
    length = [1] * len(shape)
    dims: list[int] = []
    for size, stride in zip(map(int, view.shape), view.stride(), strict=True):
        if size == 1:
            continue
        matches = [
            j for j, (n, c) in enumerate(zip(shape, strides, strict=True)) if c == stride and n > 1
        ]
        if len(matches) != 1 or matches[0] in dims:
            return None
        (dim,) = matches
        if start[dim] + size > shape[dim]:
            return None
        length[dim] = size
        dims.append(dim)
    return _Box(tuple(start), tuple(length)), dims


@dataclass(frozen=True)
class Piece:
    """One copy: checkpoint tensor ``name``'s box ``src`` into parameter ``param``'s box
    ``dst``; view dim ``d`` runs along checkpoint dim ``src_dims[d]`` and parameter dim
    ``dst_dims[d]``."""

    name: str
    shape: tuple[int, ...]
    src: _Box
    src_dims: tuple[int, ...]
    param: str
    param_shape: tuple[int, ...]
    dst: _Box
    dst_dims: tuple[int, ...]

    @property
    def numel(self) -> int:
        """Elements copied."""
        return self.src.numel

    def _view_sizes(self) -> tuple[int, ...]:
        return tuple(self.src.length[j] for j in self.src_dims)

    def _dst_offset(self) -> int:
        strides = _contiguous_strides(self.param_shape)
        return sum(s * c for s, c in zip(self.dst.start, strides, strict=True))

    def _dst_strides(self) -> tuple[int, ...]:
        strides = _contiguous_strides(self.param_shape)
        return tuple(strides[p] for p in self.dst_dims)

    def source_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """The box of the (contiguous) checkpoint tensor this piece copies (a view of it, at
        any storage offset)."""
        strides = _contiguous_strides(self.shape)
        offset = sum(s * c for s, c in zip(self.src.start, strides, strict=True))
        flat = tensor.reshape(-1)
        return flat.as_strided(
            self._view_sizes(),
            tuple(strides[j] for j in self.src_dims),
            flat.storage_offset() + offset,
        )

    def target_view(self, flat: torch.Tensor) -> torch.Tensor:
        """The box of the parameter (as its flat contiguous view ``flat``) this piece
        writes."""
        return flat.as_strided(
            self._view_sizes(), self._dst_strides(), flat.storage_offset() + self._dst_offset()
        )

    def select(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Of row-major checkpoint indices (int64), which fall in this piece (a mask) and
        where those land in the parameter's flat storage."""
        index = unravel(indices, self.shape)
        inside = self.src.contains(index)
        positions = torch.full((int(inside.sum()),), self._dst_offset(), dtype=torch.int64)
        for stride, dim in zip(self._dst_strides(), self.src_dims, strict=True):
            positions += (index[dim][inside] - self.src.start[dim]) * stride
        return inside, positions

    def read_at(
        self, tensor: torch.Tensor, index: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Of parameter positions ``index`` (a multi-index: one int64 tensor per parameter dim),
        which this piece writes (a mask), and the elements of checkpoint tensor ``tensor`` it
        writes there."""
        inside = self.dst.contains(index)
        strides = _contiguous_strides(self.shape)
        start = sum(s * c for s, c in zip(self.src.start, strides, strict=True))
        flat = torch.full((int(inside.sum()),), start, dtype=torch.int64)
        for src_dim, dst_dim in zip(self.src_dims, self.dst_dims, strict=True):
            flat += (index[dst_dim][inside] - self.dst.start[dst_dim]) * strides[src_dim]
        return inside, tensor.reshape(-1)[flat]

    def flat_range(self) -> tuple[int, int] | None:
        """``(source start, target start)`` when the piece copies a run of consecutive
        checkpoint elements to consecutive parameter elements (rows of a row-major tensor, a
        whole tensor), else None."""
        src = _run(self.src, self.shape)
        dst = _run(self.dst, self.param_shape)
        same_order = list(self.src_dims) == sorted(self.src_dims) and list(self.dst_dims) == sorted(
            self.dst_dims
        )
        if src is None or dst is None or not same_order:
            return None
        return src, dst


def _run(box: _Box, shape: tuple[int, ...]) -> int | None:
    """The flat start of ``box`` when its elements are consecutive in a row-major tensor."""
    partial = [j for j, (n, size) in enumerate(zip(box.length, shape, strict=True)) if n != size]
    if partial and any(n != 1 for n in box.length[: partial[-1]]):
        return None
    strides = _contiguous_strides(shape)
    return sum(s * c for s, c in zip(box.start, strides, strict=True))


@dataclass(frozen=True)
class Fill:
    """A constant written into parameter ``param``'s box ``dst`` (padding)."""

    param: str
    dst: _Box
    value: float

    def holds(self, flat: torch.Tensor, shape: tuple[int, ...]) -> bool:
        """Whether the parameter of ``shape`` (as its flat storage ``flat``) holds the constant
        in the box."""
        return bool((_box_view(flat, shape, self.dst) == self.value).all())


@dataclass
class WriteMap:
    """The recorded writes of one worker's ``load_weights``.

    Attributes:
        pieces: checkpoint name -> its copies.
        fills: parameter -> constants written into it.
        casts: checkpoint name -> its copies into parameters of another dtype (each element
            cast: the values follow from the checkpoint, its bits cannot be written in place).
        irregular: parameter -> why its writes cannot be replayed from checkpoint elements.
        written_by: parameter -> the checkpoint tensors it was written from (for a write the
            map cannot replay: the tensor the loader had taken last).
    """

    pieces: dict[str, list[Piece]] = field(default_factory=dict)
    fills: dict[str, list[Fill]] = field(default_factory=dict)
    casts: dict[str, list[Piece]] = field(default_factory=dict)
    irregular: dict[str, str] = field(default_factory=dict)
    written_by: dict[str, set[str]] = field(default_factory=dict)

    def params(self) -> dict[str, list[Piece]]:
        """Parameter -> the pieces written into it."""
        by_param: dict[str, list[Piece]] = {}
        for pieces in self.pieces.values():
            for piece in pieces:
                by_param.setdefault(piece.param, []).append(piece)
        return by_param

    def not_in_place(self) -> dict[str, str]:
        """Parameter -> why checkpoint bits cannot be written into it in place (irregular, or
        written with a cast)."""
        casts = {
            piece.param: f"{piece.name} is cast to the parameter's dtype"
            for pieces in self.casts.values()
            for piece in pieces
        }
        return {**casts, **self.irregular}

    def uncovered(self, param: str, shape: tuple[int, ...]) -> str | None:
        """Why the boxes of ``param`` (copies, casts and fills) do not cover it exactly once
        (None: they do)."""
        casts = [p.dst for ps in self.casts.values() for p in ps if p.param == param]
        boxes = [p.dst for p in self.params().get(param, [])] + casts
        boxes += [f.dst for f in self.fills.get(param, [])]
        for i, box in enumerate(boxes):
            if any(box.overlaps(other) for other in boxes[i + 1 :]):
                return "two writes overlap"
        covered = sum(box.numel for box in boxes)
        numel = math.prod(shape)
        return None if covered == numel else f"{covered} of {numel} elements written"

    def verify(
        self, weights: Iterable[tuple[str, torch.Tensor]], params: Mapping[str, torch.Tensor]
    ) -> dict[str, str]:
        """Round-trip every parameter of ``params`` (name -> the contiguous runtime tensor,
        loaded from ``weights``) through the map; parameter -> why it failed (empty: all
        hold)."""
        failed: dict[str, str] = {}
        for param, tensor in params.items():
            flat = tensor.detach().view(-1)
            for fill in self.fills.get(param, []):
                if not fill.holds(flat, tuple(tensor.shape)):
                    failed[param] = f"padding holds other values than {fill.value}"
        for name, checkpoint in weights:
            for piece in self.pieces.get(name, []):
                runtime = params.get(piece.param)
                if runtime is None or piece.param in failed:
                    continue
                reason = _round_trip(piece, checkpoint.contiguous(), runtime.detach().view(-1))
                if reason is not None:
                    failed[piece.param] = f"{name}: {reason}"
        return failed


def _box_view(flat: torch.Tensor, shape: tuple[int, ...], box: _Box) -> torch.Tensor:
    strides = _contiguous_strides(shape)
    offset = sum(s * c for s, c in zip(box.start, strides, strict=True))
    return flat.as_strided(box.length, strides, flat.storage_offset() + offset)


def _round_trip(piece: Piece, tensor: torch.Tensor, flat: torch.Tensor) -> str | None:
    """Why the parameter's storage does not hold the checkpoint box ``piece`` copies."""
    if tuple(tensor.shape) != piece.shape:
        return f"checkpoint shape {tuple(tensor.shape)}, mapped as {piece.shape}"
    source = int_view(piece.source_view(tensor)).to(flat.device)
    target = int_view(piece.target_view(flat))
    if not torch.equal(source, target):
        return "runtime bits differ from the checkpoint box"
    generator = torch.Generator().manual_seed(len(piece.name))
    sample = torch.randint(0, math.prod(piece.shape), (_SAMPLE,), generator=generator)
    inside, positions = piece.select(sample)
    expected = int_view(tensor.reshape(-1))[sample[inside]].to(flat.device)
    if not torch.equal(int_view(flat)[positions.to(flat.device)], expected):
        return "the delta index arithmetic reads other bits"
    return None


def _written(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensors an aten op writes (in-place and ``out=`` arguments)."""
    written = []
    schema = func._schema
    for position, argument in enumerate(schema.arguments):
        alias = argument.alias_info
        if alias is None or not alias.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(argument.name)
        if isinstance(value, torch.Tensor):
            written.append(value)
    return written


def _storage_key(tensor: torch.Tensor) -> int:
    return int(tensor.untyped_storage()._cdata)


class _Recorder(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the writes into parameters instead of making them."""

    def __init__(
        self,
        params: Mapping[int, tuple[str, torch.Tensor]],
        sources: Mapping[int, tuple[str, torch.Tensor]],
        found: WriteMap,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._params = params
        self._sources = sources
        self._map = found
        self.current: str | None = None
        """The checkpoint tensor the loader took last."""

    def _irregular(self, param: str, reason: str) -> None:
        self._map.irregular.setdefault(param, reason)
        if self.current is not None:
            self._map.written_by.setdefault(param, set()).add(self.current)

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        targets = [
            (t, self._params[_storage_key(t)])
            for t in _written(func, args, kwargs)
            if _storage_key(t) in self._params
        ]
        if not targets:
            return func(*args, **kwargs)
        for view, (param, tensor) in targets:
            self._record(func, args, view, param, tensor)
        return targets[0][0]

    def _record(
        self, func: Any, args: tuple[Any, ...], view: torch.Tensor, param: str, tensor: torch.Tensor
    ) -> None:
        if view.numel() == 0:
            return
        shape = tuple(map(int, tensor.shape))
        found = _box_of(view, int(tensor.storage_offset()), shape)
        if found is None:
            self._irregular(param, f"{func} writes a view that is not a box")
            return
        dst, dst_dims = found
        if func in (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default):
            value = float(args[1]) if func is torch.ops.aten.fill_.Scalar else 0.0
            self._map.fills.setdefault(param, []).append(Fill(param, dst, value))
            return
        source = args[1] if func is torch.ops.aten.copy_.default else None
        origin = (
            self._sources.get(_storage_key(source)) if isinstance(source, torch.Tensor) else None
        )
        if origin is None or not isinstance(source, torch.Tensor) or source.shape != view.shape:
            self._irregular(param, f"{func} writes values computed by the loader")
            return
        name, checkpoint = origin
        box = _box_of(source, int(checkpoint.storage_offset()), tuple(map(int, checkpoint.shape)))
        if box is None or len(box[1]) != len(dst_dims):
            self._irregular(param, f"copies a view of {name} that is not a box")
            return
        src, src_dims = box
        piece = Piece(
            name, tuple(checkpoint.shape), src, tuple(src_dims), param, shape, dst, tuple(dst_dims)
        )
        (self._map.casts if source.dtype != view.dtype else self._map.pieces).setdefault(
            name, []
        ).append(piece)
        self._map.written_by.setdefault(param, set()).add(name)


def record_writes(
    params: Mapping[str, torch.Tensor],
    weights: Mapping[str, torch.Tensor],
    load: Callable[[Iterator[tuple[str, torch.Tensor]]], object],
) -> WriteMap:
    """Run ``load(weights' items)`` (which loads them into ``params``) with every write into
    a parameter recorded instead of made; what it wrote where."""
    found = WriteMap()
    by_storage = {_storage_key(t): (name, t) for name, t in params.items()}
    sources = {_storage_key(t): (name, t) for name, t in weights.items()}
    recorder = _Recorder(by_storage, sources, found)

    def taken() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights.items():
            recorder.current = name
            yield name, tensor

    with recorder:
        load(taken())
    return found


def _original_loader(loader: Any) -> Any:
    """A weight loader without vLLM's layerwise-reload wrappers, which stay on the reload's
    checkpoint-shape tensors after a reload and skip loading outside one."""
    while getattr(loader, "__name__", "") == "online_process_loader":
        loader = loader.__wrapped__
    return loader


def capture_write_map(
    model: Any, specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
) -> WriteMap:
    """Record where ``model.load_weights`` writes each checkpoint tensor of ``specs`` (name ->
    shape and dtype), without reading or writing any value (see the module docstring). Every
    parameter of the model is left as it was.

    Raises:
        RuntimeError: the model's loader cannot run on meta tensors (it reads values).
    """
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import restore_layer_on_meta

    saved: list[tuple[Any, dict[str, Any], dict[str, Any], set[str]]] = []
    for layer in model.modules():
        saved.append(
            (
                layer,
                dict(layer._parameters),
                dict(layer._buffers),
                set(layer._non_persistent_buffers_set),
            )
        )
    wrapped: list[tuple[Any, Any]] = []
    try:
        for layer in model.modules():
            restore_layer_on_meta(layer, get_layerwise_info(layer))
        for _, param in model.named_parameters(remove_duplicate=False):
            loader = getattr(param, "weight_loader", None)
            if loader is not None and _original_loader(loader) is not loader:
                wrapped.append((param, loader))
                param.weight_loader = _original_loader(loader)
        weights = {
            name: torch.empty(shape, dtype=dtype, device="meta")
            for name, (shape, dtype) in specs.items()
        }
        found = record_writes(
            dict(model.named_parameters(remove_duplicate=False)), weights, model.load_weights
        )
    finally:
        for param, loader in wrapped:
            param.weight_loader = loader
        for layer, parameters, buffers, non_persistent in saved:
            for name in list(layer._parameters) + list(layer._buffers):
                delattr(layer, name)
            for name, value in parameters.items():
                layer._parameters[name] = value
            for name, value in buffers.items():
                layer._buffers[name] = value
            layer._non_persistent_buffers_set = non_persistent
    logger.info(
        "write map: %d checkpoint tensors, %d irregular parameters",
        len(found.pieces),
        len(found.irregular),
    )
    return found
