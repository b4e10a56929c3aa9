"""Checks that a bench report's summary ratios say what its own rows say.

A bench's test states, independently of the bench's code, which rows each summary ratio
compares (the subject, then the reference); :func:`check_summary_ratios` recomputes every
ratio from the per-round values those rows record and fails on any that differs: an inverted
ratio (subject and reference swapped), one built from the wrong rows, or a
``<ratio>_reference_gbps`` that is not the reference's rate. Rows record a measured rate as
``{field: median, field + "_rounds": [per-round values]}``
(:func:`refit_lab.bench.harness.rate_fields`); benches with one row per round (``inflight``)
give one value per matching row instead.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from refit_lab.bench.harness import BenchReport, median_ratio

__all__ = ["Ratio", "Side", "Worst", "check_summary_ratios"]

Row = Mapping[str, object]


@dataclass(frozen=True)
class Side:
    """One side of a ratio: the ``field`` of the report's rows that match ``where``.

    One matching row: its ``field + "_rounds"`` list (one value per round), or its ``field``
    as a single round. Several matching rows: one round each, in row order.
    """

    field: str
    where: Mapping[str, object] = dataclasses.field(default_factory=dict)

    def rounds(self, rows: Sequence[Row]) -> list[float]:
        """The side's per-round values."""
        matching = [row for row in rows if all(row.get(k) == v for k, v in self.where.items())]
        if not matching:
            raise AssertionError(f"no row matches {dict(self.where)}")
        if len(matching) == 1 and f"{self.field}_rounds" in matching[0]:
            return [_number(v) for v in _list(matching[0][f"{self.field}_rounds"])]
        return [_number(row.get(self.field)) for row in matching]

    def median_problems(self, rows: Sequence[Row]) -> list[str]:
        """Where a matching row's recorded median is not the median of its own rounds."""
        problems = []
        for row in rows:
            if all(row.get(k) == v for k, v in self.where.items()) and (
                f"{self.field}_rounds" in row
            ):
                median = statistics.median(_number(v) for v in _list(row[f"{self.field}_rounds"]))
                if not math.isclose(_number(row.get(self.field)), median, rel_tol=1e-9):
                    problems.append(
                        f"row {dict(self.where)}: {self.field} {row.get(self.field)!r} is not"
                        f" the median of its rounds ({median!r})"
                    )
        return problems


@dataclass(frozen=True)
class Ratio:
    """A summary ratio: the median over paired rounds of ``subject`` / ``reference``; with
    ``time``, of reference / subject (the subject's time over the reference's, from rates)."""

    subject: Side
    reference: Side
    time: bool = False

    def value(self, rows: Sequence[Row]) -> float:
        """The ratio the rows give."""
        subject, reference = self.subject.rounds(rows), self.reference.rounds(rows)
        if self.time:
            return median_ratio(reference, subject)
        return median_ratio(subject, reference)

    def reference_gbps(self, rows: Sequence[Row]) -> float | None:
        """The reference's median rate, where its field is a rate (its name says ``gbps``)."""
        if "gbps" not in self.reference.field:
            return None
        return statistics.median(self.reference.rounds(rows))

    def median_problems(self, rows: Sequence[Row]) -> list[str]:
        """Rows whose recorded median disagrees with their own rounds."""
        return self.subject.median_problems(rows) + self.reference.median_problems(rows)


@dataclass(frozen=True)
class Worst:
    """A summary ratio that is the lowest (or highest) of several, e.g. over receiver counts."""

    ratios: Sequence[Ratio]
    pick: Literal["lowest", "highest"] = "lowest"

    def chosen(self, rows: Sequence[Row]) -> Ratio:
        """The ratio the summary must report."""
        choose = min if self.pick == "lowest" else max
        return choose(self.ratios, key=lambda ratio: ratio.value(rows))

    def value(self, rows: Sequence[Row]) -> float:
        """The worst ratio's value."""
        return self.chosen(rows).value(rows)

    def reference_gbps(self, rows: Sequence[Row]) -> float | None:
        """The worst ratio's reference rate."""
        return self.chosen(rows).reference_gbps(rows)

    def median_problems(self, rows: Sequence[Row]) -> list[str]:
        """Rows whose recorded median disagrees with their own rounds."""
        return [p for ratio in self.ratios for p in ratio.median_problems(rows)]


def check_summary_ratios(
    report: BenchReport,
    ratios: Mapping[str, Ratio | Worst],
    *,
    other_keys: Iterable[str] = (),
) -> None:
    """Fail unless every ratio in ``report.summary`` is what ``ratios`` computes from the
    report's rows.

    Args:
        report: a bench's report.
        ratios: summary key -> which rows it compares. A ``<key>_reference_gbps`` beside a
            key must be the reference side's median rate.
        other_keys: the summary's numbers that are not ratios of rows (rates, counts, bounds
            derived otherwise); every other numeric key must be in ``ratios``, so a ratio the
            bench adds later cannot go unchecked.

    Raises:
        AssertionError: listing every disagreement.
    """
    rows = report.results
    summary = report.summary
    problems: list[str] = []
    declared = set(ratios) | {f"{key}_reference_gbps" for key in ratios} | set(other_keys)
    for key, value in summary.items():
        if not isinstance(value, bool) and key not in declared:
            problems.append(f"summary {key!r} is neither a checked ratio nor declared other")
    for key, ratio in ratios.items():
        try:
            expected = ratio.value(rows)
            reference = ratio.reference_gbps(rows)
        except (AssertionError, TypeError, ValueError) as error:
            problems.append(f"{key}: the rows cannot give it: {error}")
            continue
        problems += [f"{key}: {p}" for p in ratio.median_problems(rows)]
        got = summary.get(key)
        if not isinstance(got, int | float) or not math.isclose(got, expected, rel_tol=1e-9):
            problems.append(
                f"{key} = {got!r}, but its rows give {expected!r} (inverse {1 / expected!r})"
            )
        reported = summary.get(f"{key}_reference_gbps")
        if reported is not None and (
            reference is None or not math.isclose(float(reported), reference, rel_tol=1e-9)
        ):
            problems.append(
                f"{key}_reference_gbps = {reported!r}, but the reference's rows give {reference!r}"
            )
    if problems:
        raise AssertionError(f"bench {report.bench!r}:\n  " + "\n  ".join(problems))


def _list(value: object) -> list[object]:
    if not isinstance(value, list | tuple):
        raise TypeError(f"expected a list of rounds, got {value!r}")
    return list(value)


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)
