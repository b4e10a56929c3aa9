"""DynamoWorkerEndpoint: validation, metadata parsing, pickling."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from refit_dynamo import DynamoWorkerEndpoint


def test_endpoint_is_frozen_picklable_and_normalized() -> None:
    endpoint = DynamoWorkerEndpoint("7", "http://10.0.0.3:9090/")
    assert endpoint.system_url == "http://10.0.0.3:9090"
    assert endpoint.route_url("pause_generation") == "http://10.0.0.3:9090/engine/pause_generation"
    assert pickle.loads(pickle.dumps(endpoint)) == endpoint
    with pytest.raises(dataclasses.FrozenInstanceError):
        endpoint.system_url = "http://elsewhere"  # type: ignore[misc]


def test_from_metadata_accepts_dynamo_integer_ids() -> None:
    endpoint = DynamoWorkerEndpoint.from_metadata(
        {"instance_id": 7587890123, "system_url": "https://w0.cluster:8081", "extra": "ignored"}
    )
    assert endpoint == DynamoWorkerEndpoint("7587890123", "https://w0.cluster:8081")


@pytest.mark.parametrize(
    ("metadata", "match"),
    [
        ({"system_url": "http://h:1"}, "lacks instance_id"),
        ({"instance_id": "a"}, "lacks system_url"),
        ({}, "lacks instance_id, system_url"),
        (
            {"instance_id": True, "system_url": "http://h:1"},
            "instance_id must be an int or a string",
        ),
        (
            {"instance_id": 1.5, "system_url": "http://h:1"},
            "instance_id must be an int or a string",
        ),
        ({"instance_id": "", "system_url": "http://h:1"}, "non-empty"),
        ({"instance_id": "a", "system_url": 8080}, "system_url must be a string"),
        ({"instance_id": "a", "system_url": "ftp://h:1"}, "http"),
        ({"instance_id": "a", "system_url": "localhost:8080"}, "http"),
        ({"instance_id": "a", "system_url": "http://"}, "http"),
        ({"instance_id": "a", "system_url": "http://h:99999"}, "not a valid URL"),
        ({"instance_id": "a", "system_url": "http://h:1/?x=1"}, "query"),
    ],
)
def test_from_metadata_rejects_bad_fields(metadata: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        DynamoWorkerEndpoint.from_metadata(metadata)


def test_from_metadata_rejects_non_mappings() -> None:
    with pytest.raises(ValueError, match="mapping"):
        DynamoWorkerEndpoint.from_metadata([("instance_id", "a")])  # type: ignore[arg-type]
