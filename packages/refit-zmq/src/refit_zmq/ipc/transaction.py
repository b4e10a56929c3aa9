"""Worker side: what one refit promised (its manifest) and what it has loaded so far.

Checks run before anything is loaded: the manifest against the engine's checkpoint specs at
``begin``, and every item of a bucket against the manifest before the bucket is loaded. At
the completion sentinel every manifest name must have been loaded exactly once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from refit_core import GeometryMismatchError, ProtocolError, TensorSpec
from refit_zmq.ipc.protocol import Item, slot_bytes
from refit_zmq.ipc.sizing import ALIGN_BYTES

__all__ = ["RefitTransaction", "check_manifest"]

_LISTED = 5
"""Names quoted per kind of mismatch in an error message."""


def check_manifest(manifest: Mapping[str, TensorSpec], engine: Mapping[str, TensorSpec]) -> None:
    """Raise GeometryMismatchError unless ``manifest`` names exactly the engine's tensors,
    each with the engine's shape and dtype."""
    problems = []
    unknown = sorted(set(manifest) - set(engine))
    missing = sorted(set(engine) - set(manifest))
    wrong = sorted(n for n in set(manifest) & set(engine) if manifest[n] != engine[n])
    if unknown:
        problems.append(f"{len(unknown)} unknown to the engine {unknown[:_LISTED]}")
    if missing:
        problems.append(f"{len(missing)} of the engine's missing {missing[:_LISTED]}")
    if wrong:
        details = [f"{n}: {manifest[n]} (engine {engine[n]})" for n in wrong[:_LISTED]]
        problems.append(f"{len(wrong)} with another shape or dtype {details}")
    if problems:
        raise GeometryMismatchError("manifest does not match the engine: " + "; ".join(problems))


class RefitTransaction:
    """One refit on one worker, from ``begin`` to the completion sentinel."""

    def __init__(self, version: int, manifest: Mapping[str, TensorSpec]) -> None:
        self.version = version
        self.manifest = dict(manifest)
        self.loaded: set[str] = set()
        self.next_seq = 0

    def check_bucket(self, seq: int, items: Sequence[Item], memory_bytes: int) -> None:
        """Raise unless bucket ``seq`` is the next one and each item is expected, new, of the
        manifest's spec, aligned, and inside the bucket's memory."""
        if seq != self.next_seq:
            raise ProtocolError(f"bucket {seq} arrived, expected {self.next_seq}")
        names: set[str] = set()
        for item in items:
            expected = self.manifest.get(item.name)
            if expected is None:
                raise GeometryMismatchError(f"{item.name!r} is not in this refit's manifest")
            if item.name in self.loaded or item.name in names:
                raise GeometryMismatchError(f"{item.name!r} was sent twice")
            if item.spec != expected:
                raise GeometryMismatchError(f"{item.name!r} is {item.spec}, manifest {expected}")
            if item.offset % ALIGN_BYTES or item.offset + slot_bytes(item.spec) > memory_bytes:
                raise ProtocolError(f"{item.name!r} at offset {item.offset} is not a valid slot")
            names.add(item.name)

    def record(self, items: Sequence[Item]) -> None:
        """Note a bucket as loaded."""
        self.loaded.update(item.name for item in items)
        self.next_seq += 1

    def check_complete(self, count: int) -> None:
        """At the completion sentinel: raise unless every manifest name was loaded, once."""
        missing = sorted(set(self.manifest) - self.loaded)
        if missing:
            raise GeometryMismatchError(
                f"refit to version {self.version} ended with {len(missing)} tensors never "
                f"loaded: {missing[:_LISTED]}"
            )
        if count != len(self.loaded):
            raise GeometryMismatchError(
                f"the trainer sent {count} tensors, this worker loaded {len(self.loaded)}"
            )
