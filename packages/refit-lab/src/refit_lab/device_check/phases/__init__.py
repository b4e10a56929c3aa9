"""The device check's phases: each module's ``run()`` returns its JSON-ready result
(``ok`` False when the phase found a failure)."""

from __future__ import annotations

__all__ = ["PHASE_MODULES"]

PHASE_MODULES = {
    "environment": "refit_lab.device_check.phases.environment",
    "references": "refit_lab.device_check.phases.references",
    "gpu-tests": "refit_lab.device_check.phases.gpu_tests",
    "ipc": "refit_lab.device_check.phases.ipc",
    "codec": "refit_lab.device_check.phases.codec",
    "collective": "refit_lab.device_check.phases.collective",
    "megatron": "refit_lab.device_check.phases.megatron",
}
"""Phase name -> the module whose ``run()`` runs it."""
