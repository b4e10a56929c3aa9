"""A tiny CPU inference engine that stands in for vLLM/SGLang in refit's tests.

The model is a Llama/Qwen2-style decoder whose parameters use vLLM's fused layout
(``qkv_proj`` and ``gate_up_proj``), while ``load_weights`` takes HF checkpoint names. The
engine decodes greedily and keeps a prefix KV cache across requests that, like a real
engine's, is NOT invalidated by ``load_weights``: refit code must call
``reset_prefix_cache()``. It takes refit's engine notifications (``on_refit_begin`` /
``on_refit_abort`` / ``on_refit_commit``): while a refit writes its weights, and after one
failed part-way until a complete refit commits, it generates nothing. A request in flight
when a refit begins is held at its next step boundary and continues on the new weights
(its prefix recomputed under them); its output names the weight version of each token span.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from refit_lab.digest import combined_digest, state_digest
from refit_lab.serving_gate import GateState, ServingGate

__all__ = [
    "GenerationOutput",
    "KVCache",
    "PrefixCacheStats",
    "ReferenceEngine",
    "ReferenceModel",
    "ReferenceModelConfig",
    "WeightVersionSpan",
    "checkpoint_tensor_specs",
    "fuse_checkpoint",
    "random_checkpoint",
]

logger = logging.getLogger(__name__)

KVCache = tuple[tuple[torch.Tensor, torch.Tensor], ...]
"""Per layer ``(keys, values)``, each ``[batch, num_kv_heads, seq, head_dim]`` float32."""

_SUPPORTED_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class ReferenceModelConfig:
    """Shape of the reference model; ``dtype`` names the parameter dtype without ``torch.``."""

    vocab_size: int = 256
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_seq_len: int = 128
    dtype: str = "bfloat16"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        for field in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "max_seq_len",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        if self.dtype not in _SUPPORTED_DTYPES:
            raise ValueError(
                f"dtype must be one of {sorted(_SUPPORTED_DTYPES)}, got {self.dtype!r}"
            )
        if not self.rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps!r}")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a ``torch.dtype``."""
        return _SUPPORTED_DTYPES[self.dtype]


def checkpoint_tensor_specs(config: ReferenceModelConfig) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF checkpoint name -> ``(shape, dtype name)``, in checkpoint order."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    specs: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}"
        specs[f"{prefix}.input_layernorm.weight"] = (hidden,)
        specs[f"{prefix}.self_attn.q_proj.weight"] = (q_rows, hidden)
        specs[f"{prefix}.self_attn.k_proj.weight"] = (kv_rows, hidden)
        specs[f"{prefix}.self_attn.v_proj.weight"] = (kv_rows, hidden)
        specs[f"{prefix}.self_attn.o_proj.weight"] = (hidden, q_rows)
        specs[f"{prefix}.post_attention_layernorm.weight"] = (hidden,)
        specs[f"{prefix}.mlp.gate_proj.weight"] = (inter, hidden)
        specs[f"{prefix}.mlp.up_proj.weight"] = (inter, hidden)
        specs[f"{prefix}.mlp.down_proj.weight"] = (hidden, inter)
    specs["model.norm.weight"] = (hidden,)
    specs["lm_head.weight"] = (config.vocab_size, hidden)
    return {name: (shape, config.dtype) for name, shape in specs.items()}


def random_checkpoint(config: ReferenceModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """A deterministic random checkpoint in HF names and ``config.dtype``.

    Norm weights are ``1 + 0.1 * N(0, 1)``, the embedding ``N(0, 1)``, projections
    ``N(0, 1 / fan_in)`` and ``lm_head`` ``N(0, 4 / fan_in)``, so greedy logits are
    well separated and different seeds decode differently.
    """
    generator = torch.Generator().manual_seed(seed)
    checkpoint: dict[str, torch.Tensor] = {}
    for name, (shape, _) in checkpoint_tensor_specs(config).items():
        values = torch.randn(shape, generator=generator, dtype=torch.float32)
        if len(shape) == 1:
            values = 1.0 + 0.1 * values
        elif name == "lm_head.weight":
            values = values * (2.0 / math.sqrt(shape[1]))
        elif name != "model.embed_tokens.weight":
            values = values / math.sqrt(shape[1])
        checkpoint[name] = values.to(config.torch_dtype)
    return checkpoint


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()


def _linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x @ weight.float().t()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


@contextmanager
def _single_threaded() -> Iterator[None]:
    """Run torch with one intra-op thread, restoring the previous count afterwards.

    The model's ops are far too small to gain from threads, and on a loaded machine
    OpenMP's waiting made two-thread generation about 50x slower than one thread.
    """
    previous = torch.get_num_threads()
    if previous == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


class _Weight(nn.Module):
    """A module holding one frozen ``weight`` parameter, named like vLLM's layers."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, fill: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full(shape, fill, dtype=dtype), requires_grad=False)


class _Attention(nn.Module):
    def __init__(self, config: ReferenceModelConfig) -> None:
        super().__init__()
        self.config = config
        q_rows = config.num_heads * config.head_dim
        kv_rows = config.num_kv_heads * config.head_dim
        self.qkv_proj = _Weight((q_rows + 2 * kv_rows, config.hidden_size), config.torch_dtype)
        self.o_proj = _Weight((config.hidden_size, q_rows), config.torch_dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.config
        batch, seq, _ = x.shape
        q_rows = cfg.num_heads * cfg.head_dim
        kv_rows = cfg.num_kv_heads * cfg.head_dim
        q, k, v = torch.split(_linear(x, self.qkv_proj.weight), [q_rows, kv_rows, kv_rows], -1)
        q = q.view(batch, seq, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = k.view(batch, seq, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        v = v.view(batch, seq, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if past is not None:
            k = torch.cat((past[0], k), dim=2)
            v = torch.cat((past[1], v), dim=2)
        group = cfg.num_heads // cfg.num_kv_heads
        keys = k.repeat_interleave(group, dim=1)
        values = v.repeat_interleave(group, dim=1)
        total = keys.shape[2]
        scores = (q @ keys.transpose(-1, -2)) / math.sqrt(cfg.head_dim)
        query_pos = torch.arange(total - seq, total).unsqueeze(1)
        future = torch.arange(total).unsqueeze(0) > query_pos
        scores = scores.masked_fill(future, float("-inf"))
        attended = torch.softmax(scores, dim=-1) @ values
        out = attended.transpose(1, 2).reshape(batch, seq, q_rows)
        return _linear(out, self.o_proj.weight), (k, v)


class _MLP(nn.Module):
    def __init__(self, config: ReferenceModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = _Weight(
            (2 * config.intermediate_size, config.hidden_size), config.torch_dtype
        )
        self.down_proj = _Weight((config.hidden_size, config.intermediate_size), config.torch_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = torch.split(_linear(x, self.gate_up_proj.weight), self.intermediate_size, -1)
        return _linear(F.silu(gate) * up, self.down_proj.weight)


class _DecoderLayer(nn.Module):
    def __init__(self, config: ReferenceModelConfig) -> None:
        super().__init__()
        self.eps = config.norm_eps
        self.input_layernorm = _Weight((config.hidden_size,), config.torch_dtype, fill=1.0)
        self.self_attn = _Attention(config)
        self.post_attention_layernorm = _Weight((config.hidden_size,), config.torch_dtype, 1.0)
        self.mlp = _MLP(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        past: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        attn, present = self.self_attn(
            _rms_norm(x, self.input_layernorm.weight, self.eps), cos, sin, past
        )
        x = x + attn
        x = x + self.mlp(_rms_norm(x, self.post_attention_layernorm.weight, self.eps))
        return x, present


class _DecoderModel(nn.Module):
    def __init__(self, config: ReferenceModelConfig) -> None:
        super().__init__()
        self.embed_tokens = _Weight((config.vocab_size, config.hidden_size), config.torch_dtype)
        self.layers = nn.ModuleList(_DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = _Weight((config.hidden_size,), config.torch_dtype, fill=1.0)


class ReferenceModel(nn.Module):
    """Llama-style decoder in vLLM's fused parameter layout; computes in float32.

    Parameters are created zero (norm weights one) and frozen; fill them through
    :meth:`ReferenceEngine.load_weights`.
    """

    def __init__(self, config: ReferenceModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _DecoderModel(config)
        self.lm_head = _Weight((config.vocab_size, config.hidden_size), config.torch_dtype)
        inv_freq = 1.0 / (
            config.rope_theta
            ** (torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim)
        )
        angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float64), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self._rope_cos = angles.cos().float()
        self._rope_sin = angles.sin().float()

    def forward(
        self, input_ids: torch.Tensor, past_kv: KVCache | None = None
    ) -> tuple[torch.Tensor, KVCache]:
        """Run ``input_ids`` ``[batch, seq]`` after ``past_kv``.

        Returns float32 logits ``[batch, seq, vocab]`` and the KV of past plus new tokens.
        Runs torch with one intra-op thread (process-wide, restored on return).
        """
        cfg = self.config
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if past_kv is not None and len(past_kv) != cfg.num_layers:
            raise ValueError(f"past_kv has {len(past_kv)} layers, expected {cfg.num_layers}")
        past_len = 0 if past_kv is None else past_kv[0][0].shape[2]
        end = past_len + input_ids.shape[1]
        if end > cfg.max_seq_len:
            raise ValueError(f"sequence length {end} exceeds max_seq_len {cfg.max_seq_len}")
        cos = self._rope_cos[past_len:end]
        sin = self._rope_sin[past_len:end]
        present: list[tuple[torch.Tensor, torch.Tensor]] = []
        with _single_threaded():
            hidden = F.embedding(input_ids, self.model.embed_tokens.weight).float()
            for index, layer in enumerate(self.model.layers):
                layer_past = None if past_kv is None else past_kv[index]
                hidden, layer_kv = layer(hidden, cos, sin, layer_past)
                present.append(layer_kv)
            hidden = _rms_norm(hidden, self.model.norm.weight, cfg.norm_eps)
            logits = _linear(hidden, self.lm_head.weight)
        return logits, tuple(present)


@dataclass(frozen=True)
class WeightVersionSpan:
    """Output tokens ``[start, end)`` were generated under weights of ``version`` (the
    fields of vLLM's ``CompletionOutput.weight_versions`` spans)."""

    version: int
    start: int
    end: int


@dataclass(frozen=True)
class GenerationOutput:
    """Greedy continuations, one per prompt.

    Attributes:
        tokens: per prompt, the generated tokens.
        weight_version: the version that generated the last tokens (the version served when
            the request ended).
        weight_versions: per prompt, the versions of its token spans, in order, covering
            every generated token (one span unless a refit committed during the request).
    """

    tokens: list[list[int]]
    weight_version: int
    weight_versions: list[list[WeightVersionSpan]]


@dataclass
class _Request:
    """One prompt being decoded: ``fed`` tokens of its sequence are in ``past``, computed
    under the weights of ``version``; ``starts`` holds ``(first token, version)`` per span."""

    prompt: list[int]
    generated: list[int] = dataclasses.field(default_factory=list)
    starts: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    past: KVCache | None = None
    fed: int = 0
    version: int | None = None

    def spans(self) -> list[WeightVersionSpan]:
        ends = [start for start, _ in self.starts[1:]] + [len(self.generated)] * bool(self.starts)
        return [WeightVersionSpan(v, s, e) for (s, v), e in zip(self.starts, ends, strict=True)]


@dataclass(frozen=True)
class PrefixCacheStats:
    """Prefix-cache counters; ``hits``/``misses`` count prompts, ``resets`` the invalidations."""

    hits: int
    misses: int
    hit_tokens: int
    entries: int
    max_entries: int
    resets: int


@dataclass(frozen=True)
class _Target:
    """Where a checkpoint tensor lives: rows ``[start, stop)`` of parameter ``param``."""

    param: str
    start: int
    stop: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _checkpoint_targets(config: ReferenceModelConfig) -> dict[str, _Target]:
    specs = checkpoint_tensor_specs(config)
    fused = {
        "self_attn.q_proj": "self_attn.qkv_proj",
        "self_attn.k_proj": "self_attn.qkv_proj",
        "self_attn.v_proj": "self_attn.qkv_proj",
        "mlp.gate_proj": "mlp.gate_up_proj",
        "mlp.up_proj": "mlp.gate_up_proj",
    }
    targets: dict[str, _Target] = {}
    offsets: dict[str, int] = {}
    for name, (shape, _) in specs.items():
        param = name
        for part, fused_part in fused.items():
            if f".{part}." in name:
                param = name.replace(part, fused_part)
        start = offsets.get(param, 0)
        offsets[param] = start + shape[0]
        targets[name] = _Target(param, start, start + shape[0], shape, config.torch_dtype)
    return targets


def fuse_checkpoint(
    config: ReferenceModelConfig, checkpoint: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Checkpoint-named tensors -> :class:`ReferenceModel` parameters (fused ``qkv_proj`` and
    ``gate_up_proj``), by ``torch.cat``, so gradients flow back to the checkpoint tensors.

    Raises:
        KeyError: a checkpoint name the model needs is missing.
    """
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, target in _checkpoint_targets(config).items():
        parts.setdefault(target.param, []).append((target.start, checkpoint[name]))
    return {
        param: torch.cat([tensor for _, tensor in sorted(pieces, key=lambda p: p[0])])
        for param, pieces in parts.items()
    }


class ReferenceEngine:
    """Greedy CPU engine over :class:`ReferenceModel` with a cross-request prefix KV cache.

    Prompts are prefilled one token per step, exactly like decoding, so a prefix-cache hit
    reproduces a miss bit for bit under unchanged weights. Each public call holds the engine
    lock, so a ``load_weights`` call never interleaves with a ``generate`` call.
    """

    def __init__(
        self,
        config: ReferenceModelConfig,
        *,
        seed: int | None = None,
        max_prefix_cache_entries: int = 64,
        max_pause_s: float = 60.0,
    ) -> None:
        """Build the engine; with a ``seed`` it loads ``random_checkpoint(config, seed)``.
        A request in flight is held through a refit's pause for at most ``max_pause_s``."""
        if max_pause_s <= 0:
            raise ValueError(f"max_pause_s must be > 0, got {max_pause_s}")
        if max_prefix_cache_entries < 0:
            raise ValueError(
                f"max_prefix_cache_entries must be >= 0, got {max_prefix_cache_entries}"
            )
        self._config = config
        self._model = ReferenceModel(config).eval()
        self._targets = _checkpoint_targets(config)
        self._lock = threading.RLock()
        self._weight_version = 0
        self._max_entries = max_prefix_cache_entries
        self._prefix_cache: OrderedDict[tuple[int, ...], KVCache] = OrderedDict()
        self._hits = 0
        self._misses = 0
        self._hit_tokens = 0
        self._resets = 0
        self._gate = ServingGate()
        self._max_pause_s = max_pause_s
        self._tokens_generated = 0
        if seed is not None:
            self.load_weights(random_checkpoint(config, seed).items())

    @property
    def config(self) -> ReferenceModelConfig:
        """The model configuration."""
        return self._config

    @property
    def model(self) -> ReferenceModel:
        """The underlying model (fused parameter layout)."""
        return self._model

    @property
    def weight_version(self) -> int:
        """Version of the loaded weights, 0 until :meth:`set_weight_version` is called."""
        return self._weight_version

    def set_weight_version(self, version: int) -> None:
        """Commit a new weight version; it must be greater than the current one."""
        with self._lock:
            if version <= self._weight_version:
                raise ValueError(
                    f"weight version must increase: current {self._weight_version}, got {version}"
                )
            logger.debug("weight version %s -> %s", self._weight_version, version)
            self._weight_version = version

    @property
    def tokens_generated(self) -> int:
        """Tokens generated since the engine was built (all requests)."""
        return self._tokens_generated

    @property
    def serving_state(self) -> GateState:
        """Open (serving), paused (a refit writes) or closed (partial weights)."""
        return self._gate.state

    def on_refit_begin(self, version: int) -> None:
        """A refit to ``version`` is about to write the weights: stop generating at the next
        step boundary (requests in flight are held, not aborted). The gate closes first,
        so no new step starts, then this waits for the step in progress: requests that take
        the engine lock back to back cannot starve the refit."""
        self._gate.pause(f"a refit to version {version} is writing the weights")
        with self._lock:
            pass

    def on_refit_abort(self, version: int, *, weights_changed: bool) -> None:
        """The refit failed: serve the old weights again, or stay closed on partial ones."""
        if weights_changed:
            self._gate.close(f"the refit to version {version} failed part-way")
        else:
            self._gate.open()

    def on_refit_commit(self, version: int) -> None:
        """The weights are complete at ``version``: serve."""
        self._gate.open()

    def checkpoint_tensor_specs(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Checkpoint name -> ``(shape, dtype name)`` accepted by :meth:`load_weights`."""
        return checkpoint_tensor_specs(self._config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint-named tensors into the fused parameters, in place.

        Each tensor is validated before it is copied: an unknown name raises ``KeyError``, a
        wrong shape or dtype ``ValueError``; tensors copied earlier in the same call stay
        copied. Does not reset the prefix cache. Returns the names loaded.
        """
        loaded: set[str] = set()
        with self._lock, torch.no_grad():
            params = dict(self._model.named_parameters())
            for name, tensor in weights:
                target = self._targets.get(name)
                if target is None:
                    raise KeyError(f"unknown checkpoint tensor {name!r}")
                if tuple(tensor.shape) != target.shape:
                    raise ValueError(
                        f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {target.shape}"
                    )
                if tensor.dtype != target.dtype:
                    raise ValueError(
                        f"tensor {name!r} has dtype {tensor.dtype}, expected {target.dtype}"
                    )
                params[target.param][target.start : target.stop].copy_(tensor)
                loaded.add(name)
        logger.debug("loaded %s checkpoint tensors", len(loaded))
        return loaded

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The live weights under checkpoint names: views into the fused parameters."""
        params = dict(self._model.named_parameters())
        return {
            name: params[target.param].detach()[target.start : target.stop]
            for name, target in self._targets.items()
        }

    def state_digests(self) -> dict[str, int]:
        """Per checkpoint name, the bitwise digest of the engine's live weights."""
        with self._lock:
            return state_digest(self.checkpoint_tensors().items())

    def combined_digest(self) -> str:
        """One hex digest over :meth:`state_digests`."""
        return combined_digest(self.state_digests())

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix (required after new weights are loaded)."""
        with self._lock:
            dropped = len(self._prefix_cache)
            self._prefix_cache.clear()
            self._resets += 1
        logger.debug("prefix cache reset, %s entries dropped", dropped)

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """Snapshot of the prefix-cache counters."""
        with self._lock:
            return PrefixCacheStats(
                hits=self._hits,
                misses=self._misses,
                hit_tokens=self._hit_tokens,
                entries=len(self._prefix_cache),
                max_entries=self._max_entries,
                resets=self._resets,
            )

    def generate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, wait_s: float = 0.0
    ) -> GenerationOutput:
        """Greedily decode ``max_new_tokens`` tokens after each non-empty prompt.

        Prompts are decoded together, one token each per step. A refit that begins pauses the
        request at the next step boundary; it resumes on the new weights (its tokens so far
        computed again under them), and its ``weight_versions`` show where it switched.

        Args:
            wait_s: how long to hold the request, before it starts, while a refit pauses or
                closes the engine.

        Raises:
            EngineClosedError: the engine was still paused or closed after ``wait_s``; or,
                once started, the engine closed (a refit failed part-way) or stayed paused
                longer than ``max_pause_s``.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        token_lists = [[int(token) for token in prompt] for prompt in prompts]
        for index, tokens in enumerate(token_lists):
            self._validate_prompt(index, tokens, max_new_tokens)
        self._gate.wait_open(wait_s)
        requests = [_Request(tokens) for tokens in token_lists]
        version = self._weight_version
        while requests and len(requests[0].generated) < max_new_tokens:
            with self._lock, torch.no_grad():
                if self._gate.state is GateState.OPEN:
                    version = self._weight_version
                    for request in requests:
                        self._advance(request, version)
                    continue
            self._gate.hold(self._max_pause_s)
        return GenerationOutput(
            tokens=[r.generated for r in requests],
            weight_version=version,
            weight_versions=[r.spans() for r in requests],
        )

    def _validate_prompt(self, index: int, tokens: list[int], max_new_tokens: int) -> None:
        cfg = self._config
        if not tokens:
            raise ValueError(f"prompt {index} is empty")
        if any(token < 0 or token >= cfg.vocab_size for token in tokens):
            raise ValueError(f"prompt {index} has a token outside [0, {cfg.vocab_size})")
        if len(tokens) + max_new_tokens > cfg.max_seq_len:
            raise ValueError(
                f"prompt {index}: {len(tokens)} tokens + {max_new_tokens} new tokens "
                f"exceed max_seq_len {cfg.max_seq_len}"
            )

    def _advance(self, request: _Request, version: int) -> None:
        """Generate one token of ``request`` under ``version``'s weights; its KV is computed
        again first when it was computed under other weights (or not yet)."""
        sequence = request.prompt + request.generated
        if request.version != version:
            request.fed, request.past = self._lookup_prefix(sequence)
            request.version = version
        logits: torch.Tensor | None = None
        for token in sequence[request.fed :]:
            logits, request.past = self._step(token, request.past)
        assert logits is not None and request.past is not None  # the last token is always fed
        request.fed = len(sequence)
        if not request.generated:
            self._store_prefix(request.prompt, request.past)
        if not request.starts or request.starts[-1][1] != version:
            request.starts.append((len(request.generated), version))
        request.generated.append(int(torch.argmax(logits)))
        self._tokens_generated += 1

    def _step(self, token: int, past: KVCache | None) -> tuple[torch.Tensor, KVCache]:
        logits, present = self._model(torch.tensor([[token]], dtype=torch.long), past)
        last: torch.Tensor = logits[0, -1]
        return last, present

    def _lookup_prefix(self, prompt: list[int]) -> tuple[int, KVCache | None]:
        """Longest cached prefix of ``prompt``, capped so the last token is recomputed."""
        lengths = range(len(prompt), 0, -1) if len(prompt) > 1 else range(0)
        for length in lengths:
            key = tuple(prompt[:length])
            cached = self._prefix_cache.get(key)
            if cached is None:
                continue
            self._prefix_cache.move_to_end(key)
            reused = min(length, len(prompt) - 1)
            self._hits += 1
            self._hit_tokens += reused
            return reused, tuple((k[:, :, :reused], v[:, :, :reused]) for k, v in cached)
        self._misses += 1
        return 0, None

    def _store_prefix(self, prompt: list[int], kv: KVCache) -> None:
        if self._max_entries == 0:
            return
        key = tuple(prompt)
        self._prefix_cache[key] = kv
        self._prefix_cache.move_to_end(key)
        while len(self._prefix_cache) > self._max_entries:
            self._prefix_cache.popitem(last=False)
