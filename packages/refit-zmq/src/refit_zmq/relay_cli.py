"""``refit relay``: start a relay process, or read relays' status (no tree needed).

    refit relay serve --shapes "embed=512x256:bfloat16,norm=256:float32" --seed 0
    refit relay serve --safetensors model.safetensors --bind "tcp://10.0.0.5:*"
    refit relay status tcp://127.0.0.1:41234 tcp://127.0.0.1:41235 [--digests]

``python -m refit_zmq.relay`` takes the same arguments. This module lives outside the relay
package and imports it only when a command runs, so ``refit --help`` loads nothing heavy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "register"]


def _version(text: str) -> int | None:
    return None if text == "none" else int(text)


def _add_serve(parser: argparse.ArgumentParser) -> None:
    from refit_zmq.relay.wire.tuning import RelayTuning

    tensors = parser.add_mutually_exclusive_group(required=True)
    tensors.add_argument("--shapes", help='random tensors: "name=512x256:bfloat16,..."')
    tensors.add_argument("--safetensors", help="the tensors of a safetensors file")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random tensors")
    parser.add_argument(
        "--version", type=_version, default=0, help="version the tensors hold (none: unknown)"
    )
    parser.add_argument("--bind", default="tcp://127.0.0.1:*", help="where the relay listens")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="the relay's timeout")
    parser.add_argument("--api-key-env", default=None, help="variable holding the API key")
    described = _attributes(RelayTuning.__doc__ or "")
    for option in dataclasses.fields(RelayTuning):
        parser.add_argument(
            f"--{option.name.replace('_', '-')}",
            type=type(option.default),
            default=option.default,
            help=described.get(option.name, ""),
        )
    parser.set_defaults(handler=_serve)


def _attributes(docstring: str) -> dict[str, str]:
    """``name -> text`` of the ``Attributes:`` section of a Google-style docstring."""
    described: dict[str, str] = {}
    name = ""
    for line in docstring.partition("Attributes:")[2].splitlines():
        entry = re.fullmatch(r"\s{8}(\w+): (.*)", line)
        if entry:
            name = entry[1]
            described[name] = entry[2]
        elif name and line.strip():
            described[name] += " " + line.strip()
    return described


def _serve(args: argparse.Namespace) -> int:
    from refit_zmq.relay.launch import RelayProcess, parse_shapes, random_state, read_safetensors
    from refit_zmq.relay.wire.tuning import RelayTuning

    try:
        tuning = RelayTuning(
            **{
                option.name: getattr(args, option.name)
                for option in dataclasses.fields(RelayTuning)
            }
        )
        if args.shapes is not None:
            tensors = random_state(parse_shapes(args.shapes), args.seed)
        else:
            tensors = read_safetensors(args.safetensors)
    except (ValueError, OSError) as exc:
        sys.stderr.write(f"refit relay serve: {exc}\n")
        return 2
    process = RelayProcess(args.bind, args.version, args.timeout_s, args.api_key_env, tuning)
    return process.serve(tensors, sys.stdout)


def _add_status(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("relays", nargs="+", help="relay addresses")
    parser.add_argument("--digests", action="store_true", help="every tensor's digest too")
    parser.add_argument("--api-key-env", default=None, help="variable holding the API key")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="wait per relay")
    parser.set_defaults(handler=_status)


def _status(args: argparse.Namespace) -> int:
    from refit_core import RefitError
    from refit_core.backend import Deadline
    from refit_zmq.relay.coordinator.coordinator import RelayCoordinator
    from refit_zmq.relay.wire.auth import api_key_from_env
    from refit_zmq.relay.wire.curve import CurveConfig

    coordinator = RelayCoordinator(
        api_key=api_key_from_env(args.api_key_env),
        timeout_s=args.timeout_s,
        curve=CurveConfig.from_env(),
    )
    try:
        # no refit to bound: each relay gets the usual attempts of --timeout-s
        statuses = coordinator.status(
            digests=args.digests, relays=args.relays, deadline=Deadline.never()
        )
    finally:
        coordinator.close()
    report: dict[str, Any] = {
        address: {"error": str(status)} if isinstance(status, RefitError) else status.to_json()
        for address, status in statuses.items()
    }
    json.dump(report, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0 if all(not isinstance(s, RefitError) for s in statuses.values()) else 1


def _add_commands(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="relay_command", metavar="ACTION", required=True)
    shown = argparse.ArgumentDefaultsHelpFormatter
    _add_serve(
        commands.add_parser("serve", help="run one relay over given tensors", formatter_class=shown)
    )
    _add_status(
        commands.add_parser("status", help="read relays' status (read-only)", formatter_class=shown)
    )


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``refit relay`` (the ``refit.cli`` entry point)."""
    _add_commands(subparsers.add_parser("relay", help="run or inspect a sparse-refit relay"))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m refit_zmq.relay``."""
    parser = argparse.ArgumentParser(
        prog="python -m refit_zmq.relay", description="Run or inspect a sparse-refit relay."
    )
    _add_commands(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    status: int = args.handler(args)
    return status
