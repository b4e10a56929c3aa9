"""Transformer-shaped bf16 states and the deltas an optimizer step makes to them, for benches.

fp32 master weights take one AdamW step (moments from a few steps of random gradients), then
are cast to bf16; the learning rate is calibrated so that a given fraction of the bf16
elements change. Everything runs on the device asked for (a GPU makes multi-GiB states in
seconds).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

__all__ = [
    "ModelShape",
    "State",
    "Trajectory",
    "calibrate_lr",
    "same_bits",
    "simulate_adamw",
    "state_bytes",
    "uniform_case",
]

State = dict[str, torch.Tensor]

_BETAS = (0.9, 0.999)
_EPS = 1e-8
_WEIGHT_DECAY = 0.01
_MOMENT_STEPS = 3
_CALIBRATION_SAMPLES = 1 << 21
_BISECTION_STEPS = 40
_HIDDEN_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of the synthetic transformer."""

    hidden: int
    intermediate: int
    vocab: int
    layers: int

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint name -> shape, in the order an engine loads them."""
        h, inter = self.hidden, self.intermediate
        shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (self.vocab, h)}
        for i in range(self.layers):
            prefix = f"layers.{i}"
            shapes[f"{prefix}.input_layernorm.weight"] = (h,)
            shapes[f"{prefix}.self_attn.qkv_proj.weight"] = (3 * h, h)
            shapes[f"{prefix}.self_attn.o_proj.weight"] = (h, h)
            shapes[f"{prefix}.post_attention_layernorm.weight"] = (h,)
            shapes[f"{prefix}.mlp.gate_up_proj.weight"] = (2 * inter, h)
            shapes[f"{prefix}.mlp.down_proj.weight"] = (h, inter)
        shapes["norm.weight"] = (h,)
        return shapes

    @property
    def nbytes(self) -> int:
        """bf16 bytes of the whole state."""
        return 2 * sum(torch.Size(shape).numel() for shape in self.shapes().values())

    @classmethod
    def of_bytes(cls, nbytes: int) -> ModelShape:
        """A Llama-like shape of at least ``nbytes`` of bf16 (by less than a layer): the widest
        hidden size whose one-layer model is at most a quarter of the state."""
        hidden = _HIDDEN_SIZES[0]
        for size in _HIDDEN_SIZES:
            if cls._of(size, 1).nbytes <= max(nbytes // 4, cls._of(_HIDDEN_SIZES[0], 1).nbytes):
                hidden = size
        one, two = cls._of(hidden, 1).nbytes, cls._of(hidden, 2).nbytes
        layers = max(1, -(-(nbytes - one) // (two - one)) + 1)
        return cls._of(hidden, layers)

    @classmethod
    def _of(cls, hidden: int, layers: int) -> ModelShape:
        intermediate = round(2.75 * hidden / 64) * 64
        return cls(hidden, intermediate, vocab=8 * hidden, layers=layers)


def state_bytes(state: Mapping[str, torch.Tensor]) -> int:
    """Bytes of every tensor of a state."""
    return sum(t.numel() * t.element_size() for t in state.values())


@dataclass(frozen=True)
class Trajectory:
    """fp32 master weights and one AdamW step direction: ``w - lr * step`` is the update."""

    master: State
    step: State

    def bf16(self, lr: float) -> State:
        """The bf16 weights after a step of learning rate ``lr`` (0: the current weights)."""
        return {
            name: (w - lr * self.step[name]).to(torch.bfloat16) if lr else w.to(torch.bfloat16)
            for name, w in self.master.items()
        }


def simulate_adamw(model: ModelShape, *, seed: int, device: str = "cpu") -> Trajectory:
    """Master weights (normal 0.02, norms at 1) and an AdamW step from random-gradient moments."""
    gen = torch.Generator(device=device).manual_seed(seed)
    b1, b2 = _BETAS
    master: State = {}
    step: State = {}
    for name, shape in model.shapes().items():
        noise = torch.randn(shape, generator=gen, device=device)
        w = 1.0 + 0.01 * noise if len(shape) == 1 else 0.02 * noise
        m = torch.zeros(shape, device=device)
        v = torch.zeros(shape, device=device)
        for _ in range(_MOMENT_STEPS):
            g = 1e-3 * torch.randn(shape, generator=gen, device=device)
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
        m_hat = m / (1 - b1**_MOMENT_STEPS)
        v_hat = v / (1 - b2**_MOMENT_STEPS)
        step[name] = m_hat.div_(v_hat.sqrt_().add_(_EPS)).add_(w, alpha=_WEIGHT_DECAY)
        master[name] = w
    return Trajectory(master, step)


def _changed_fraction(w: torch.Tensor, step: torch.Tensor, lr: float) -> float:
    before = w.to(torch.bfloat16).view(torch.int16)
    after = (w - lr * step).to(torch.bfloat16).view(torch.int16)
    return float((before != after).double().mean())


def calibrate_lr(trajectory: Trajectory, fraction: float) -> float:
    """The learning rate at which about ``fraction`` of the bf16 elements change (bisection)."""
    total = sum(w.numel() for w in trajectory.master.values())
    stride = max(1, total // _CALIBRATION_SAMPLES)
    w = torch.cat([t.reshape(-1)[::stride] for t in trajectory.master.values()])
    step = torch.cat([t.reshape(-1)[::stride] for t in trajectory.step.values()])
    lo, hi = -14.0, 0.0
    for _ in range(_BISECTION_STEPS):
        mid = (lo + hi) / 2
        if _changed_fraction(w, step, 10.0**mid) < fraction:
            lo = mid
        else:
            hi = mid
    return float(10.0 ** ((lo + hi) / 2))


def uniform_case(old: State, fraction: float, *, seed: int) -> State:
    """``old`` with ``fraction`` of the elements, at uniform positions, set to other random bits."""
    gen = torch.Generator().manual_seed(seed)
    new: State = {}
    for name, tensor in old.items():
        bits = tensor.clone().view(torch.int16).view(-1)
        hit = torch.rand(bits.numel(), generator=gen) < fraction
        flips = torch.randint(1, 1 << 16, (int(hit.sum()),), generator=gen, dtype=torch.int32)
        bits[hit] ^= flips.to(torch.int16)
        new[name] = bits.view(torch.bfloat16).view(tensor.shape)
    return new


def same_bits(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Whether two states hold exactly the same bits."""
    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(torch.int16), b[k].view(torch.int16)) for k in a
    )
