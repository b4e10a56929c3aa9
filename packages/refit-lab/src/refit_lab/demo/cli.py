"""The ``refit demo`` subcommand: progress bar per step, final table, optional JSON."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any

from refit_lab.demo.settings import ENGINES, FAULTS, MODELS, TRANSPORTS, DemoSettings

__all__ = ["register", "run_command"]

logger = logging.getLogger(__name__)

_DEFAULTS = DemoSettings()
_VLLM_WORKERS = 2  # each vLLM engine takes ~30 s to start on a CPU host
_INFLIGHT_TRANSPORT = "collective"  # the reference engines' row that stages
NO_VLLM = (
    "--engine vllm needs vLLM, which is not importable in this environment; run "
    "scripts/demo-vllm [OPTIONS] instead (it builds the engine venv .venv-engine the way "
    "scripts/test-engine does and runs `refit demo --engine vllm` from it)"
)
"""What ``refit demo --engine vllm`` says where vLLM is missing (exit status 2)."""


class _BarProgress:
    """One tqdm bar per step (on stderr), advanced stage by stage."""

    def __init__(self, description: str, total: int) -> None:
        from tqdm import tqdm

        self._bar: Any = tqdm(total=total, desc=description, unit="stage", file=sys.stderr)

    def advance(self, stage: str) -> None:
        self._bar.set_postfix_str(f"{stage} done")
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``demo`` to ``subparsers``."""
    parser = subparsers.add_parser(
        "demo",
        help="train a small model and refit a local fleet after every step, verified",
        description=(
            "Start a local Ray cluster, train a small GPT-like model with AdamW (bf16 forward, "
            "fp32 masters) on synthetic tokens, refit N reference-engine workers after every "
            "step, and verify each refit bitwise and by greedy generation."
        ),
    )
    parser.add_argument(
        "--transport",
        choices=TRANSPORTS,
        help=(
            f"default {_DEFAULTS.transport} ({_INFLIGHT_TRANSPORT} with --inflight). "
            "zmq_sparse: sparse deltas over the ZMQ relay tree; collective: the packed "
            "gloo/NCCL broadcast; ipc: the colocated IPC channel; dynamo: the Dynamo row, one "
            "process per worker running Dynamo's real system server and RL admin routes over "
            "a reference engine, verified through the worker's routes (served version, every "
            "rank's bits and greedy tokens); no Ray, no --fault"
        ),
    )
    parser.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help=f"inference workers (default {_DEFAULTS.workers}; {_VLLM_WORKERS} with --engine vllm)",
    )
    parser.add_argument("--steps", type=int, default=_DEFAULTS.steps, metavar="K")
    parser.add_argument("--model", choices=sorted(MODELS), default=_DEFAULTS.model)
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="reference",
        help=(
            "inference engine of the workers. reference: refit-lab's CPU engine in Ray "
            "actors, verified bitwise and against the trainer's greedy tokens. vllm: real vLLM "
            "engines in this process, no Ray (needs vLLM: scripts/demo-vllm); --model small or "
            "medium, no --fault; each refit checks the served version, the engines' tokens "
            "agreeing and (zmq_sparse) the receiver's checkpoint-format bits; at the end a "
            "fresh vLLM engine on the final weights must generate every engine's tokens"
        ),
    )
    parser.add_argument(
        "--inflight",
        action="store_true",
        help=(
            "refit while serving: clients keep every engine generating through the whole run; "
            "each refit is staged while they do and committed in one short pause, shown "
            "beside the refit time (reference engines, --transport collective); no request "
            "may be lost"
        ),
    )
    parser.add_argument("--fault", choices=sorted(FAULTS), help="inject into one refit")
    parser.add_argument("--fault-step", type=int, metavar="S", help="default: the middle step")
    parser.add_argument(
        "--timeout", type=float, default=_DEFAULTS.timeout_s, metavar="S", help="refit deadline"
    )
    parser.add_argument("--lr", type=float, default=_DEFAULTS.lr, help="AdamW learning rate")
    parser.add_argument("--json", type=Path, dest="json_path", metavar="PATH")
    parser.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    """Handler of ``refit demo``: 0 when every refit verified, 1 otherwise, 2 on bad arguments."""
    if args.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        sys.stderr.write(f"refit demo: {NO_VLLM}\n")
        return 2
    workers = args.workers
    if workers is None:
        workers = _VLLM_WORKERS if args.engine == "vllm" else _DEFAULTS.workers
    try:
        transport = args.transport
        if transport is None:
            transport = _INFLIGHT_TRANSPORT if args.inflight else _DEFAULTS.transport
        settings = DemoSettings(
            transport=transport,
            workers=workers,
            steps=args.steps,
            model=args.model,
            fault=args.fault,
            fault_step=args.fault_step,
            timeout_s=args.timeout,
            lr=args.lr,
            engine=args.engine,
            inflight=args.inflight,
        )
    except ValueError as exc:
        logger.error("%s", exc)
        sys.stderr.write(f"refit demo: {exc}\n")
        return 2
    from refit_lab.demo.run import run_demo

    report = run_demo(settings, _BarProgress)
    sys.stdout.write(report.table() + "\n")
    if args.json_path is not None:
        report.write_json(args.json_path)
    sys.stdout.write(
        "every refit verified\n" if report.ok else "VERIFICATION FAILED (see the table)\n"
    )
    return 0 if report.ok else 1
