"""The `refit bench` subcommand: run registered benches, print tables, write JSON and plots."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TextIO

from refit_lab.bench.harness import (
    BENCHES,
    SIZED_BENCHES,
    BenchContext,
    BenchReport,
    BenchUnavailableError,
    format_table,
    load_bench,
    write_json,
)
from refit_lab.bench.plots import write_plots
from refit_lab.bench.runtime import default_threads

logger = logging.getLogger(__name__)

ALL = "all"


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `bench NAME [--quick] [--json PATH] [--out-dir DIR] [--threads N] [--device D]
    [--bytes N]` to `subparsers`."""
    parser = subparsers.add_parser(
        "bench",
        help="run a benchmark against its references",
        description="Run a registered benchmark (or all of them), print a table, write JSON.",
    )
    parser.add_argument("name", choices=[*BENCHES, ALL], help="bench to run, or 'all'")
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument(
        "--json", type=Path, dest="json_path", metavar="PATH", help="write the report's JSON here"
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=Path("bench-results"),
        metavar="DIR",
        help="with 'all': directory for one NAME.json per bench, and PNG plots where"
        " matplotlib is installed (default: bench-results/)",
    )
    parser.add_argument(
        "--threads",
        type=_positive_int,
        default=default_threads(),
        metavar="N",
        help="torch threads for the code under test and the references (default: cores available)",
    )
    sized = ", ".join(SIZED_BENCHES)
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help=f"where the state lives ({sized} only; default cpu)",
    )
    parser.add_argument(
        "--bytes",
        type=_positive_int,
        dest="size_bytes",
        metavar="N",
        help=f"state size in bytes instead of the quick or full size ({sized} only)",
    )
    parser.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace, stream: TextIO | None = None) -> int:
    """Handler of `refit bench`: 0 on success, 1 if a bench failed, 2 on bad arguments."""
    out = sys.stdout if stream is None else stream
    run_all = args.name == ALL
    if run_all and args.json_path is not None:
        logger.error("--json takes one bench; with 'all' use --out-dir")
        return 2
    device, size_bytes = getattr(args, "device", "cpu"), getattr(args, "size_bytes", None)
    if (device != "cpu" or size_bytes is not None) and args.name not in SIZED_BENCHES:
        logger.error("--device and --bytes take one of: %s", ", ".join(SIZED_BENCHES))
        return 2
    ctx = BenchContext(quick=args.quick, threads=args.threads, device=device, size_bytes=size_bytes)
    failed: list[str] = []
    reports: dict[str, BenchReport] = {}
    for name in list(BENCHES) if run_all else [args.name]:
        logger.info(
            "bench %s (%s, %d threads)", name, "quick" if ctx.quick else "full", ctx.threads
        )
        try:
            report = load_bench(name)(ctx)
        except BenchUnavailableError as exc:
            if not run_all:
                logger.error("bench %s cannot run here: %s", name, exc)
                return 2
            logger.warning("bench %s skipped: %s", name, exc)
            continue
        except Exception:
            logger.exception("bench %s failed", name)
            failed.append(name)
            continue
        out.write(format_table(report) + "\n\n")
        out.flush()
        if run_all:
            write_json(report, args.out_dir / f"{name}.json")
            reports[name] = report
        elif args.json_path is not None:
            write_json(report, args.json_path)
    if run_all:
        write_plots(reports, args.out_dir)
    if failed:
        logger.error("failed benches: %s", ", ".join(failed))
        return 1
    return 0
