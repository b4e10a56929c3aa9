"""The open registry: backend rows found through the ``refit.backends`` entry points.

Any installed package may register rows (:mod:`refit_core.rows`); core reads them, picks the
row a deployment asks for, and imports its builder on first use. For refit's own rows that
are not installed, core's table of install hints (:mod:`refit_core.known_rows`) says which
``pip install`` brings them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata
from typing import TYPE_CHECKING, Any

from refit_core import known_rows
from refit_core.errors import BackendNotInstalledError
from refit_core.known_rows import KnownRow
from refit_core.request import SynchronizerRequest
from refit_core.rows import ENTRY_POINT_GROUP, BackendRow, Topology, topology_of

if TYPE_CHECKING:
    from refit_core.synchronizer import WeightSynchronizer

__all__ = [
    "BrokenRow",
    "Discovered",
    "InstalledRow",
    "SynchronizerBuilder",
    "discover",
    "find_row",
    "load_builder",
    "load_options_type",
]

logger = logging.getLogger(__name__)

SynchronizerBuilder = Callable[[SynchronizerRequest], "WeightSynchronizer"]


@dataclass(frozen=True)
class InstalledRow:
    """A row an installed distribution registers."""

    row: BackendRow
    distribution: str
    version: str


@dataclass(frozen=True)
class BrokenRow:
    """An entry point that does not give a usable row (it fails to import, names something
    that is not a :class:`BackendRow`, or a row of another key)."""

    key: str
    value: str
    distribution: str
    error: str


@dataclass(frozen=True)
class Discovered:
    """The rows of the ``refit.backends`` entry points, usable and broken."""

    rows: tuple[InstalledRow, ...]
    broken: tuple[BrokenRow, ...]


def _distribution(ep: metadata.EntryPoint) -> tuple[str, str]:
    dist = ep.dist
    return (dist.name, dist.version) if dist is not None else ("?", "?")


def _load_row(ep: metadata.EntryPoint) -> BackendRow:
    row = ep.load()
    if not isinstance(row, BackendRow):
        raise TypeError(f"{ep.value} is a {type(row).__name__}, not a refit_core BackendRow")
    if row.key != ep.name:
        raise ValueError(f"{ep.value} declares the row {row.key}, registered as {ep.name}")
    return row


def discover(prefix: str = "") -> Discovered:
    """Read the rows whose key starts with ``prefix`` (each entry point's module is imported:
    row modules import nothing heavy)."""
    rows: list[InstalledRow] = []
    broken: list[BrokenRow] = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if not ep.name.startswith(prefix):
            continue
        name, version = _distribution(ep)
        try:
            rows.append(InstalledRow(_load_row(ep), name, version))
        except Exception as exc:
            logger.warning(
                "refit.backends entry point %s of %s is unusable: %s", ep.name, name, exc
            )
            broken.append(BrokenRow(ep.name, ep.value, name, f"{type(exc).__name__}: {exc}"))
    return Discovered(tuple(rows), tuple(broken))


def _installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _missing(known: KnownRow, alternatives: tuple[InstalledRow, ...] = ()) -> Exception:
    """The error for refit's row ``known`` when no installed package registers it."""
    version = _installed_version(known.package)
    others = ", ".join(repr(r.row.transport) for r in alternatives)
    installed = f" (installed transports: {others})" if others else ""
    if version is not None:
        return NotImplementedError(
            f"{known.key} is not implemented by {known.package} {version}{installed}; "
            f"upgrade it: {known.install_hint}"
        )
    return BackendNotInstalledError(
        f"{known.key} needs the package {known.package}, which is not installed{installed}",
        install_hint=known.install_hint,
    )


def _broken(broken: BrokenRow) -> BackendNotInstalledError:
    known = known_rows.known_row(broken.key)
    hint = known.install_hint if known else f"pip install --force-reinstall {broken.distribution}"
    return BackendNotInstalledError(
        f"{broken.key} of {broken.distribution} could not be loaded from {broken.value}: "
        f"{broken.error}",
        install_hint=hint,
    )


def _one(key: str, rows: tuple[InstalledRow, ...]) -> InstalledRow:
    if len(rows) > 1:
        owners = ", ".join(f"{r.distribution} {r.version}" for r in rows)
        raise ValueError(
            f"{key} is registered by several packages ({owners}); uninstall all but one"
        )
    return rows[0]


def _unknown(backend: str, topology: Topology, transport: str | None) -> Exception:
    """The error for a backend and topology (and transport) nothing installed or known has."""
    unsupported = known_rows.UNSUPPORTED.get((backend, topology))
    if unsupported is not None:
        return NotImplementedError(f"{backend} {topology}: {unsupported}")
    everything = discover()
    known = known_rows.KNOWN_ROWS
    backends = dict.fromkeys(
        (*(r.backend for r in known), *(r.row.backend for r in everything.rows))
    )
    if backend not in backends:
        return ValueError(f"unknown generation_backend {backend!r}; known: {', '.join(backends)}")
    here = (backend, topology)
    transports = {
        r.row.transport for r in everything.rows if (r.row.backend, r.row.topology) == here
    }
    transports |= {r.transport for r in known if (r.backend, r.topology) == here}
    if not transports:
        rows = sorted(
            {r.row.key for r in everything.rows if r.row.backend == backend}
            | {r.key for r in known if r.backend == backend}
        )
        return NotImplementedError(
            f"{backend} has no {topology} row (colocated={topology == 'colocated'}); "
            f"its rows: {', '.join(rows)}"
        )
    listed = ", ".join(repr(t) for t in sorted(transports))
    return ValueError(
        f"unknown transport {transport!r} for {backend} {topology}; known: {listed} (or None)"
    )


def find_row(backend: str, colocated: bool, transport: str | None) -> InstalledRow:
    """The installed row for a backend, topology and transport (None: the default one).

    Raises:
        ValueError: an unknown backend or transport, no default among the installed rows, or
            a row registered twice.
        NotImplementedError: a combination refit does not support (colocated dynamo), a
            topology the backend has no row for, or a row of refit's whose installed package
            does not implement it.
        BackendNotInstalledError: the row's package is missing or broken; the message says
            what to install.
    """
    if not isinstance(backend, str) or not backend:
        raise ValueError(f"generation_backend must be a non-empty string, got {backend!r}")
    if transport is not None and (not isinstance(transport, str) or not transport):
        raise ValueError(f"transport must be a non-empty string or None, got {transport!r}")
    topology = topology_of(colocated)
    if transport is not None:
        key = f"{backend}.{topology}.{transport}"
        found = discover(key)
        exact = tuple(r for r in found.rows if r.row.key == key)
        if exact:
            return _one(key, exact)
        broken = [b for b in found.broken if b.key == key]
        if broken:
            raise _broken(broken[0])
        known = known_rows.known_row(key)
        raise _missing(known) if known else _unknown(backend, topology, transport)
    prefix = f"{backend}.{topology}."
    found = discover(prefix)
    defaults = tuple(r for r in found.rows if r.row.default)
    if len(defaults) > 1:
        claims = ", ".join(f"{r.row.transport!r} ({r.distribution})" for r in defaults)
        raise ValueError(
            f"several installed rows claim to be the default of {backend} {topology}: {claims}; "
            "pass transport="
        )
    if defaults:
        return defaults[0]
    fallback = known_rows.known_default(backend, topology)
    if fallback is not None:
        raise _missing(fallback, found.rows)
    if found.rows:
        listed = ", ".join(repr(r.row.transport) for r in found.rows)
        raise ValueError(f"{backend} {topology} has no default transport; pass one of {listed}")
    if found.broken:
        raise _broken(found.broken[0])
    raise _unknown(backend, topology, None)


def _resolve(installed: InstalledRow, reference: str) -> Any:
    """Import ``"module:attribute"`` of ``installed``'s row.

    Raises:
        BackendNotInstalledError: it (or something it imports) is missing.
    """
    try:
        return metadata.EntryPoint(name="", value=reference, group="").load()
    except ImportError as exc:
        error = f"{type(exc).__name__}: {exc}"
        broken = BrokenRow(installed.row.key, reference, installed.distribution, error)
        raise _broken(broken) from exc


def load_builder(installed: InstalledRow) -> SynchronizerBuilder:
    """Import the builder of ``installed``.

    Raises:
        BackendNotInstalledError: the builder (or something it imports) is missing.
        TypeError: the row's builder is not callable.
    """
    row = installed.row
    builder = _resolve(installed, row.builder)
    if not callable(builder):
        raise TypeError(f"{row.key}: builder {row.builder} is not callable")
    logger.debug("loaded builder %s for %s", row.builder, row.key)
    loaded: SynchronizerBuilder = builder
    return loaded


def load_options_type(installed: InstalledRow) -> type | None:
    """The options class of ``installed``'s row (None: the row takes no options).

    Raises:
        BackendNotInstalledError: the options class cannot be imported.
        TypeError: the row's options reference is not a class.
    """
    row = installed.row
    if row.options is None:
        return None
    kind = _resolve(installed, row.options)
    if not isinstance(kind, type):
        raise TypeError(f"{row.key}: options {row.options} is not a class")
    return kind
