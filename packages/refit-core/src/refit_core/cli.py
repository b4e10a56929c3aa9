"""The ``refit`` command: ``refit backends`` here, further subcommands from installed packages.

A package adds a subcommand through the ``refit.cli`` entry-point group: each entry point
names a function ``register(subparsers)`` that adds one subparser and sets a default
``handler`` taking the parsed arguments and returning the exit status.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import TextIO

from refit_core import __version__, known_rows
from refit_core.registry import discover
from refit_core.text import align_columns

__all__ = ["CLI_ENTRY_POINT_GROUP", "build_parser", "main"]

logger = logging.getLogger(__name__)

CLI_ENTRY_POINT_GROUP = "refit.cli"


@dataclass(frozen=True)
class _Listed:
    """One line of ``refit backends``: an installed, broken or missing row."""

    key: str
    status: str
    package: str
    version: str | None = None
    default: bool | None = None
    can_stage: bool | None = None
    clusters: tuple[str, ...] | None = None
    options: str | None = None
    model_kinds: tuple[str, ...] | None = None
    description: str = ""
    on_failure: str | None = None
    install_hint: str | None = None
    error: str | None = None

    def record(self) -> dict[str, object]:
        backend, topology, transport = self.key.split(".", 2)
        fields = {"backend": backend, "topology": topology, "transport": transport}
        return {**fields, **dataclasses.asdict(self)}


def _listing() -> list[_Listed]:
    """Every installed row, every broken entry point, and refit's rows that are missing."""
    found = discover()
    listed = [
        _Listed(
            r.row.key,
            "installed",
            r.distribution,
            r.version,
            r.row.default,
            r.row.can_stage,
            r.row.clusters_required,
            r.row.options,
            r.row.model_kinds,
            r.row.description,
            r.row.on_failure or None,
        )
        for r in found.rows
    ]
    listed += [_Listed(b.key, "broken", b.distribution, error=b.error) for b in found.broken]
    present = {item.key for item in listed}
    for known in known_rows.KNOWN_ROWS:
        if known.key not in present:
            listed.append(
                _Listed(known.key, "missing", known.package, install_hint=known.install_hint)
            )
    return sorted(listed, key=lambda item: item.key)


def _flag(value: bool | None) -> str:
    return "-" if value is None else "yes" if value else "no"


def _write_backends(listed: Sequence[_Listed], out: TextIO) -> None:
    headers = (
        "backend", "topology", "transport", "default", "stage", "clusters", "options",
        "models", "package", "version", "status",
    )  # fmt: skip
    rows = [
        (
            *item.key.split(".", 2),
            _flag(item.default),
            _flag(item.can_stage),
            "-" if item.clusters is None else ", ".join(item.clusters) or "none",
            item.options.rpartition(":")[2] if item.options else "-",
            ", ".join(item.model_kinds) if item.model_kinds else "-",
            item.package,
            item.version or "-",
            item.status if item.status == "installed" else item.install_hint or item.error or "",
        )
        for item in listed
    ]
    for line in align_columns([headers, *rows], rule=True):
        out.write(line + "\n")
    notes = [item for item in listed if item.on_failure]
    if notes:
        out.write("\nafter a failed refit an engine serves:\n")
        for item in notes:
            out.write(f"  {item.key}: {item.on_failure}\n")


def _backends(args: argparse.Namespace) -> int:
    listed = _listing()
    out: TextIO = sys.stdout
    if args.json:
        json.dump([item.record() for item in listed], out, indent=2)
        out.write("\n")
    else:
        _write_backends(listed, out)
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
    backends = sub.add_parser(
        "backends",
        help="list every backend row: installed, broken, or missing with its install line",
    )
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
