"""The prepared check of one GPU machine (``scripts/device-check``).

Here, on CPU: ``plan`` checks the wheel folder that travels with the checkout and lists the
phases and the commands they run. On the GPU machine: ``run OUT`` runs each phase in a
process of its own under its own timeout and writes ``summary.json`` (every phase's result,
the targets with their ratios and verdicts), ``summary.md`` (ready for BENCHMARKS.md) and
``device-check.log`` into ``OUT``. ``PHASES=a,b`` picks phases.
"""

from __future__ import annotations

from refit_lab.device_check.plan import PHASES, Phase, select_phases

__all__ = ["PHASES", "Phase", "select_phases"]
