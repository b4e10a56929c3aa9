"""Megatron-Core's parallel layout of a GPT model's parameters, as :class:`ParamLayout` s.

Ranks follow Megatron-Core's default order ``tp-cp-ep-dp-pp`` with ``cp = 1``:
``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``; expert parallelism is carved out of data
parallelism (``ep_rank = dp_rank % ep``) and experts use the dense tensor-parallel size.
Layer ``i`` lives on stage ``i // (layers / pp)``; the embedding on the first stage, the final
layer norm and the output layer on the last.

Parameters are keyed by their global (checkpoint) names, layers and experts numbered globally.
Megatron's fused tensors and how a tensor-parallel rank ``r`` of ``tp`` holds them:

- ``linear_qkv`` (``[g * (q + 2) * d, hidden]`` for ``g`` query groups of ``q`` query heads of
  size ``d``) is interleaved per group: for each group, its ``q`` query heads, then its key
  head, then its value head. Global row ``(group * (q + 2) + slot) * d + i``. Rank ``r`` holds
  groups ``[r * g / tp, (r + 1) * g / tp)``, which is one contiguous span of rows.
- ``linear_fc1`` of a gated MLP (``[2 * ffn, hidden]``) is ``gate`` then ``up``; rank ``r``
  holds its slice of ``gate`` then its slice of ``up``: the two spans
  ``[r * f, (r + 1) * f)`` and ``[ffn + r * f, ffn + (r + 1) * f)`` with ``f = ffn / tp``.

Column-parallel weights (qkv, fc1, embedding and output layer: vocabulary rows) are split
along dim 0, row-parallel weights (``linear_proj``, ``linear_fc2``) along dim 1, layer norms
are replicated over tensor-parallel ranks, and everything is replicated over data parallelism.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from refit_nccl.megatron.layout import ParamLayout, Span

__all__ = ["GPTConfig", "Parallelism", "gpt_layouts"]


@dataclass(frozen=True)
class Parallelism:
    """A Megatron-Core parallel layout (``dp`` counts data-parallel replicas, ``ep`` divides it)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if min(self.tp, self.pp, self.dp, self.ep) < 1 or self.dp % self.ep:
            raise ValueError(f"invalid parallelism {self}")

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return self.tp * self.pp * self.dp

    def rank(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """Global rank of a (tensor, data, pipeline) coordinate."""
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a GPT model (gated MLP; ``experts > 0`` makes every MLP a mixture of experts)."""

    layers: int
    hidden: int
    heads: int
    query_groups: int
    ffn: int
    vocab: int
    experts: int = 0
    itemsize: int = 2

    @property
    def head_dim(self) -> int:
        """Size of one attention head."""
        return self.hidden // self.heads


def gpt_layouts(config: GPTConfig, par: Parallelism) -> dict[str, ParamLayout]:
    """Global name -> layout of every parameter of ``config`` under ``par``."""
    _check(config, par)
    return dict(_params(config, par))


def _check(config: GPTConfig, par: Parallelism) -> None:
    sizes = (
        ("hidden", config.hidden, config.heads),
        ("heads", config.heads, config.query_groups),
        ("query_groups", config.query_groups, par.tp),
        ("ffn", config.ffn, par.tp),
        ("vocab", config.vocab, par.tp),
        ("layers", config.layers, par.pp),
        ("experts", config.experts, par.ep),
    )
    bad = [f"{what} {size} % {by} != 0" for what, size, by in sizes if size % by]
    if bad:
        raise ValueError(f"{config} does not fit {par}: {'; '.join(bad)}")


_TpSpans = Callable[[int], tuple[Span, ...]]


def _params(config: GPTConfig, par: Parallelism) -> Iterator[tuple[str, ParamLayout]]:
    h, v, tp = config.hidden, config.vocab, par.tp
    qkv_rows = config.query_groups * (config.heads // config.query_groups + 2) * config.head_dim
    per_stage = config.layers // par.pp

    def layout(
        shape: tuple[int, int] | tuple[int],
        dim: int,
        spans: _TpSpans,
        stage: int,
        expert: int | None = None,
    ) -> ParamLayout:
        holders = {
            par.rank(t, d, stage): spans(t)
            for d in range(par.dp)
            if expert is None or d % par.ep == expert * par.ep // config.experts
            for t in range(tp)
        }
        return ParamLayout(shape, config.itemsize, dim, holders)

    def split(size: int) -> _TpSpans:
        return lambda t: (Span(t * size // tp, (t + 1) * size // tp),)

    def whole(size: int) -> _TpSpans:
        return lambda _: (Span(0, size),)

    def gate_up(ffn: int) -> _TpSpans:
        f = ffn // tp
        return lambda t: (Span(t * f, (t + 1) * f), Span(ffn + t * f, ffn + (t + 1) * f))

    last = par.pp - 1
    yield "embedding.word_embeddings.weight", layout((v, h), 0, split(v), 0)
    for i in range(config.layers):
        stage, pre = i // per_stage, f"decoder.layers.{i}."
        att = pre + "self_attention."
        yield att + "linear_qkv.layer_norm_weight", layout((h,), 0, whole(h), stage)
        yield att + "linear_qkv.weight", layout((qkv_rows, h), 0, split(qkv_rows), stage)
        proj_cols = config.heads * config.head_dim
        yield att + "linear_proj.weight", layout((h, proj_cols), 1, split(proj_cols), stage)
        f = config.ffn
        if not config.experts:
            yield pre + "mlp.linear_fc1.layer_norm_weight", layout((h,), 0, whole(h), stage)
            yield pre + "mlp.linear_fc1.weight", layout((2 * f, h), 0, gate_up(f), stage)
            yield pre + "mlp.linear_fc2.weight", layout((h, f), 1, split(f), stage)
            continue
        yield pre + "pre_mlp_layernorm.weight", layout((h,), 0, whole(h), stage)
        yield (
            pre + "mlp.router.weight",
            layout((config.experts, h), 0, whole(config.experts), stage),
        )
        for e in range(config.experts):
            ex = f"{pre}mlp.experts.{e}."
            yield ex + "linear_fc1.weight", layout((2 * f, h), 0, gate_up(f), stage, e)
            yield ex + "linear_fc2.weight", layout((h, f), 1, split(f), stage, e)
    yield "decoder.final_layernorm.weight", layout((h,), 0, whole(h), last)
    yield "output_layer.weight", layout((v, h), 0, split(v), last)
