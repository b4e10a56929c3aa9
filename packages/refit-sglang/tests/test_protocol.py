"""Request bodies are checked against SGLang's request structs, by the stand-in too."""

from __future__ import annotations

import pytest

from refit_core import WorkerError
from refit_lab.reference_engine import ReferenceModelConfig
from refit_nccl import CollectiveEngineRole
from refit_nccl.backend import DeviceReport
from refit_sglang import HttpClient
from refit_sglang.lifecycle import check_pause_mode
from refit_sglang.participants import EngineSettings, sglang_shards
from refit_sglang.protocol import RequestSchemaError, validate_request
from sglang_standin import StandInSGLang, serve

INIT = {
    "master_address": "127.0.0.1",
    "master_port": 29500,
    "rank_offset": 1,
    "world_size": 2,
    "group_name": "g",
    "backend": "gloo",
}


def test_valid_bodies_pass() -> None:
    validate_request("init_weights_update_group", INIT)
    validate_request(
        "update_weights_from_distributed",
        {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, 3]], "weight_version": "3"},
    )
    validate_request("pause_generation", {"mode": "retract"})


@pytest.mark.parametrize(
    ("route", "body", "problem"),
    [
        ("init_weights_update_group", {**INIT, "master_prot": 1}, "unknown field 'master_prot'"),
        (
            "init_weights_update_group",
            {k: v for k, v in INIT.items() if k != "world_size"},
            "missing field 'world_size'",
        ),
        (
            "init_weights_update_group",
            {**INIT, "master_port": "29500"},
            "'master_port' must be int",
        ),
        (
            "update_weights_from_tensor",
            {"serialized_named_tensors": ["x"], "weight_version": 3},
            "'weight_version' must be Optional",
        ),
        (
            "update_weights_from_distributed",
            {"names": ["w"], "dtypes": ["f"], "shapes": [[2.0]]},
            "'shapes' must be",
        ),
        ("pause_generation", {"mode": "pause"}, "'mode' must be"),
        ("update_weights", {}, "no refit route"),
    ],
)
def test_invalid_bodies_fail(route: str, body: dict[str, object], problem: str) -> None:
    with pytest.raises(RequestSchemaError, match=problem):
        validate_request(route, body)


def test_stand_in_refuses_a_misspelt_field() -> None:
    with serve(StandInSGLang(ReferenceModelConfig(), seed=1)) as url:
        client = HttpClient(url, control_timeout_s=5.0)
        try:
            with pytest.raises(WorkerError, match="unknown field 'flush_cach'"):
                client.call(
                    "update_weights_from_tensor",
                    {"serialized_named_tensors": [], "flush_cach": False},
                    None,
                )
            assert client.tp_size == 1 and client.device == "cpu"
            settings = EngineSettings(1 << 20, "abort", 5.0)
            (rank,) = sglang_shards([client], settings)[0]
            assert rank.call(CollectiveEngineRole.refit_device).result(10) == DeviceReport.of("cpu")
        finally:
            client.close()


def test_in_place_pause_refused() -> None:
    with pytest.raises(ValueError, match="keep KV cache"):
        check_pause_mode("in_place")
    assert check_pause_mode("retract") == "retract"
