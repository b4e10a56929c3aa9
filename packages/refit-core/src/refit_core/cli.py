"""The ``refit`` command: ``refit backends`` here, further subcommands from installed packages.

A package adds a subcommand through the ``refit.cli`` entry-point group: each entry point
names a function ``register(subparsers)`` that adds one subparser and sets a default
``handler`` taking the parsed arguments and returning the exit status.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import TextIO

from refit_core import __version__
from refit_core.registry import KNOWN_ROWS, RowStatus, row_status
from refit_core.text import align_columns

__all__ = ["CLI_ENTRY_POINT_GROUP", "build_parser", "main"]

logger = logging.getLogger(__name__)

CLI_ENTRY_POINT_GROUP = "refit.cli"


def _write_backends(statuses: Sequence[RowStatus], out: TextIO) -> None:
    headers = ("backend", "topology", "transport", "package", "installed", "implemented", "install")
    rows = [
        (
            s.row.backend,
            s.row.topology,
            s.row.transport,
            s.row.package,
            s.installed_version or "no",
            "yes" if s.implemented else "no",
            s.row.install_hint,
        )
        for s in statuses
    ]
    for line in align_columns([headers, *rows], rule=True):
        out.write(line + "\n")
    notes = [s.row for s in statuses if s.row.on_failure]
    if notes:
        out.write("\nafter a failed refit an engine serves:\n")
        for row in notes:
            out.write(f"  {row.key}: {row.on_failure}\n")


def _backends(args: argparse.Namespace) -> int:
    statuses = [row_status(row) for row in KNOWN_ROWS]
    out: TextIO = sys.stdout
    if args.json:
        records = [
            {
                "key": s.row.key,
                "backend": s.row.backend,
                "topology": s.row.topology,
                "transport": s.row.transport,
                "package": s.row.package,
                "installed_version": s.installed_version,
                "implemented": s.implemented,
                "install_hint": s.row.install_hint,
                "description": s.row.description,
                "on_failure": s.row.on_failure or None,
            }
            for s in statuses
        ]
        json.dump(records, out, indent=2)
        out.write("\n")
    else:
        _write_backends(statuses, out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, with every installed subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="refit", description="Move trained LLM weights into inference engines."
    )
    parser.add_argument("--version", action="version", version=f"refit-core {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    backends = sub.add_parser("backends", help="list every backend row and what is installed")
    backends.add_argument("--json", action="store_true", help="machine-readable output")
    backends.set_defaults(handler=_backends)
    for ep in metadata.entry_points(group=CLI_ENTRY_POINT_GROUP):
        try:
            ep.load()(sub)
        except ImportError as exc:
            logger.warning("subcommand %s unavailable: %s", ep.name, exc)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``refit`` command."""
    parser = build_parser()
    args = parser.parse_args(argv)
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    status: int = args.handler(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
