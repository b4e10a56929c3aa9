"""The open registry: rows of any installed package, found through their entry points."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import pytest

from refit_core import (
    BackendNotInstalledError,
    EngineState,
    RefitError,
    create_weight_synchronizer,
    known_rows,
)
from refit_core.backend import BackendRow
from refit_core.cli import main
from refit_core.known_rows import KnownRow
from refit_core.registry import discover, find_row

from .conftest import Install

pytestmark = pytest.mark.usefixtures("toy")


class Toy:
    """The toy backend's classes, imported once the fixture installed it."""

    def __getattr__(self, name: str) -> Any:
        import refit_toy

        return getattr(refit_toy, name)


toy = Toy()


class MeetingPoint:
    """A train_cluster with only the one method the collective-like rows call (issue 24, 8)."""

    def get_master_address_and_port(self) -> tuple[str, int]:
        return "10.0.0.7", 29500


def test_a_third_party_row_is_found_built_and_refits() -> None:
    engine = toy.ToyEngine()
    sync = create_weight_synchronizer(
        toy.ToyPolicy({"w": b"abcdefghij"}),
        engine,
        "toy",
        colocated=True,
        options=toy.ToyOptions(chunk_bytes=3),
    )
    result = sync.sync_weights()
    assert engine.weights == {"w": b"abcdefghij"} and engine.version == result.version == 1
    assert sync.options.chunk_bytes == 3
    sync.shutdown()


def test_rows_carry_their_metadata() -> None:
    rows = {r.row.key: r for r in discover("toy.").rows}
    assert set(rows) == {"toy.colocated.memory", "toy.non-colocated.wire"}
    wire = rows["toy.non-colocated.wire"]
    assert (wire.distribution, wire.version) == ("refit-toy", "0.3.0")
    assert wire.row.default and not wire.row.can_stage
    assert wire.row.clusters_required == ("train_cluster",)
    assert find_row("toy", False, None) == wire


def test_a_cluster_needs_only_the_methods_its_row_calls() -> None:
    sync = create_weight_synchronizer(
        toy.ToyPolicy({}), toy.ToyEngine(), "toy", False, train_cluster=MeetingPoint()
    )
    assert sync.meeting_point == ("10.0.0.7", 29500)
    with pytest.raises(ValueError, match=r"needs train_cluster \(an object with get_master_add"):
        create_weight_synchronizer(toy.ToyPolicy({}), toy.ToyEngine(), "toy", False)
    with pytest.raises(ValueError, match=r"object lacks get_master_address_and_port\(\)"):
        create_weight_synchronizer(
            toy.ToyPolicy({}), toy.ToyEngine(), "toy", False, train_cluster=object()
        )


@dataclass(frozen=True)
class OtherOptions:
    chunk_bytes: int = 4


def test_options_are_typed_per_row() -> None:
    with pytest.raises(ValueError, match="options of toy.colocated.memory must be ToyOptions"):
        create_weight_synchronizer(
            toy.ToyPolicy({}), toy.ToyEngine(), "toy", True, options=OtherOptions()
        )


def test_a_row_without_options_refuses_them(install: Install) -> None:
    install(
        "refit-plain",
        "1.0",
        {"toy.colocated.plain": "plain_rows:PLAIN"},
        {
            "plain_rows": (
                "from refit_core.backend import BackendRow\n"
                "PLAIN = BackendRow('toy', 'colocated', 'plain', 'refit_toy.builder:build_memory',"
                " 'no options')\n"
            )
        },
    )
    with pytest.raises(ValueError, match="toy.colocated.plain takes no options"):
        create_weight_synchronizer(
            toy.ToyPolicy({}), toy.ToyEngine(), "toy", True, transport="plain", options=object()
        )


def test_two_defaults_for_one_backend_and_topology_are_ambiguous(install: Install) -> None:
    install(
        "refit-rival",
        "1.0",
        {"toy.colocated.rival": "rival_rows:RIVAL"},
        {
            "rival_rows": (
                "from refit_core.backend import BackendRow\n"
                "RIVAL = BackendRow('toy', 'colocated', 'rival', 'refit_toy.builder:build_memory',"
                " 'a rival', default=True)\n"
            )
        },
    )
    with pytest.raises(ValueError, match=r"several installed rows claim.*'memory'.*'rival'"):
        find_row("toy", True, None)
    assert find_row("toy", True, "rival").distribution == "refit-rival"


@pytest.mark.parametrize(
    ("value", "code", "error"),
    [
        ("missing_module:ROW", "", "ModuleNotFoundError"),
        ("bad_rows:ROW", "ROW = 'vllm.colocated.ipc'", "is a str, not a refit_core BackendRow"),
        (
            "bad_rows:ROW",
            "from refit_core.backend import BackendRow\n"
            "ROW = BackendRow('toy', 'colocated', 'other', 'x:y', 'misnamed')",
            "declares the row toy.colocated.other",
        ),
    ],
)
def test_a_broken_entry_point_is_listed_and_named(
    install: Install, capsys: pytest.CaptureFixture[str], value: str, code: str, error: str
) -> None:
    install("refit-broken", "2.0", {"toy.colocated.broken": value}, {"bad_rows": code})
    with pytest.raises(BackendNotInstalledError, match=re.escape(error)) as info:
        find_row("toy", True, "broken")
    assert info.value.install_hint == "pip install --force-reinstall refit-broken"
    assert find_row("toy", True, None).row.transport == "memory"
    assert main(["backends", "--json"]) == 0
    records = {r["key"]: r for r in json.loads(capsys.readouterr().out)}
    assert records["toy.colocated.broken"]["status"] == "broken"
    assert error in records["toy.colocated.broken"]["error"]


def test_a_topology_the_backend_has_no_row_for_is_not_implemented(install: Install) -> None:
    install(
        "refit-oneway",
        "1.0",
        {"oneway.non-colocated.wire": "oneway_rows:WIRE"},
        {
            "oneway_rows": (
                "from refit_core.backend import BackendRow\n"
                "WIRE = BackendRow('oneway', 'non-colocated', 'wire',"
                " 'refit_toy.builder:build_wire', 'one way only', default=True)\n"
            )
        },
    )
    says = r"oneway has no colocated row \(colocated=True\); its rows: oneway.non-colocated.wire"
    with pytest.raises(NotImplementedError, match=says):
        create_weight_synchronizer(None, None, "oneway", colocated=True)
    with pytest.raises(NotImplementedError, match=says):
        find_row("oneway", True, "wire")


def test_the_toy_answers_status_and_recover_through_its_public_hook() -> None:
    engine = toy.ToyEngine()
    sync = create_weight_synchronizer(toy.ToyPolicy({"w": b"ab"}), engine, "toy", colocated=True)
    sync.sync_weights()
    assert sync.status().describe() == "version 1 on shards [0]"
    engine.broken = True
    with pytest.raises(RefitError, match="^toy engine: load: the engine refuses") as failed:
        sync.sync_weights()
    assert [(e.worker, e.state, e.version) for e in failed.value.engines] == [
        ("toy engine", EngineState.OLD, 1)
    ]
    assert sync.recover().after.agreed_version == 1


def test_options_are_checked_when_built() -> None:
    with pytest.raises(TypeError, match=r"ToyOptions.chunk_bytes takes int, got '3' \(str\)"):
        toy.ToyOptions(chunk_bytes="3")


def test_unknown_names_list_what_exists() -> None:
    with pytest.raises(ValueError, match="unknown generation_backend 'trt'.*vllm.*dynamo.*toy"):
        find_row("trt", True, None)
    with pytest.raises(
        ValueError, match=r"unknown transport 'pigeon' for toy non-colocated.*'wire'"
    ):
        find_row("toy", False, "pigeon")


@pytest.mark.parametrize(
    ("known", "error", "message"),
    [
        (
            KnownRow("toy", "colocated", "shm", "refit-not-installed", "toy"),
            BackendNotInstalledError,
            re.escape('pip install "refit-core[toy]"'),
        ),
        (
            KnownRow("toy", "colocated", "dma", "refit-toy", "toy"),
            NotImplementedError,
            "not implemented by refit-toy 0.3.0",
        ),
    ],
    ids=["package missing", "package too old"],
)
def test_a_known_row_that_no_installed_package_registers(
    monkeypatch: pytest.MonkeyPatch, known: KnownRow, error: type[Exception], message: str
) -> None:
    monkeypatch.setattr(known_rows, "KNOWN_ROWS", (*known_rows.KNOWN_ROWS, known))
    with pytest.raises(error, match=message):
        find_row(known.backend, colocated=True, transport=known.transport)


def test_backends_shows_default_stage_clusters_options_and_models(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["backends"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    header = lines[0]
    assert header[:8] == [
        "backend",
        "topology",
        "transport",
        "default",
        "stage",
        "clusters",
        "options",
        "models",
    ]
    wire = next(line for line in lines if line[:3] == ["toy", "non-colocated", "wire"])
    assert wire[3:] == [
        "yes",
        "no",
        "train_cluster",
        "ToyOptions",
        "dense",
        "refit-toy",
        "0.3.0",
        "installed",
    ]


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"backend": "Bad Name"}, "row backend must be a lower-case identifier"),
        ({"topology": "sideways"}, "row topology must be one of"),
        ({"builder": "no_colon"}, "row builder must be 'module:attribute'"),
        ({"options": "mod:"}, "row options must be 'module:attribute'"),
        ({"train_cluster": ["get_master_address_and_port"]}, "tuple of method names"),
        ({"model_kinds": ()}, "row model_kinds must be a non-empty tuple"),
        ({"model_kinds": ["lora"]}, "row model_kinds must be a non-empty tuple"),
        ({"model_kinds": ("LoRA",)}, "row model_kinds must be a non-empty tuple"),
    ],
)
def test_a_row_declaration_is_checked(fields: dict[str, object], error: str) -> None:
    base: dict[str, Any] = {
        "backend": "toy",
        "topology": "colocated",
        "transport": "memory",
        "builder": "m:f",
        "description": "d",
    }
    with pytest.raises(ValueError, match=re.escape(error)):
        BackendRow(**{**base, **fields})
