"""``python -m refit_lab.device_check plan | requirements | run OUT | phase NAME --out FILE``."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import logging
import os
import sys
from pathlib import Path

from refit_lab.device_check.phases import PHASE_MODULES
from refit_lab.device_check.plan import (
    THIRD_PARTY,
    TRAVEL_LIMIT_BYTES,
    check_wheels,
    env_phases,
    plan_text,
    travelling_tree_bytes,
)
from refit_lab.device_check.run import run_check


def _say(line: str) -> None:
    sys.stdout.write(f"device-check: {line}\n")
    sys.stdout.flush()


def _requirements(args: argparse.Namespace) -> int:
    sys.stdout.write(" ".join(f"{d}=={v}" for d, v in THIRD_PARTY.items()) + "\n")
    return 0


def _plan(args: argparse.Namespace) -> int:
    wheels = Path(args.wheels)
    root = Path(args.root)
    problems = check_wheels(wheels, importlib.metadata.version("refit-lab"))
    tree = travelling_tree_bytes(root)
    wheel_bytes = sum(p.stat().st_size for p in wheels.glob("*.whl")) if wheels.is_dir() else 0
    if tree + wheel_bytes > TRAVEL_LIMIT_BYTES:
        problems.append(f"tree and wheels are {(tree + wheel_bytes) >> 20} MiB, over 64 MiB")
    sys.stdout.write(plan_text(env_phases(), wheels, problems, tree) + "\n")
    return 1 if problems else 0


def _run(args: argparse.Namespace) -> int:
    commit_file = Path(args.wheels) / "COMMIT"
    commit = commit_file.read_text().strip() if commit_file.exists() else None
    phases = env_phases()
    command = f"PHASES={','.join(p.name for p in phases)} scripts/device-check {args.out}"
    summary = run_check(Path(args.out), phases, command, commit, progress=_say)
    failed = [name for name, p in summary["phases"].items() if p["status"] != "passed"]
    missed = [t["name"] for t in summary["targets"] if t["pass"] is False]
    _say(f"failed phases {failed or 'none'}; missed targets {missed or 'none'}")
    return 1 if failed or missed else 0


def _phase(args: argparse.Namespace) -> int:
    module = importlib.import_module(PHASE_MODULES[args.name])
    result = module.run()
    Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return 0 if result.get("ok") else 1


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    parser = argparse.ArgumentParser(prog="python -m refit_lab.device_check")
    commands = parser.add_subparsers(dest="command", required=True)
    wheels_default = os.environ.get("DEVICE_CHECK_WHEELS", ".device-check")
    plan = commands.add_parser("plan", help="check the wheel folder, list phases and commands")
    plan.add_argument("--wheels", default=wheels_default)
    plan.add_argument("--root", default=".")
    plan.set_defaults(handler=_plan)
    requirements = commands.add_parser("requirements", help="third-party pins to download")
    requirements.set_defaults(handler=_requirements)
    run = commands.add_parser("run", help="run the phases (on the GPU machine)")
    run.add_argument("out")
    run.add_argument("--wheels", default=wheels_default)
    run.set_defaults(handler=_run)
    phase = commands.add_parser("phase", help="run one phase in this process")
    phase.add_argument("name", choices=sorted(PHASE_MODULES))
    phase.add_argument("--out", required=True)
    phase.set_defaults(handler=_phase)
    args = parser.parse_args(argv)
    try:
        status: int = args.handler(args)
    except ValueError as exc:  # an unknown phase in PHASES
        _say(f"error: {exc}")
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
