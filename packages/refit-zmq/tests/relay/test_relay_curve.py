"""A CURVE relay: encrypted producers commit; plain or wrongly keyed ones are refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth
from relay_helpers import KEY, KEY_VAR, TUNING, RelayFleet, RelaySpec, fresh_trainer, held_digests

from refit_core import AuthenticationError, RefitTimeoutError, WeightVersion
from refit_core.backend import Deadline
from refit_zmq.relay import (
    CurveConfig,
    RelayCoordinator,
    RelayStatus,
    ZmqSparseRefitClient,
    new_transfer_id,
)

pytestmark = pytest.mark.timeout(120)

KEYS = CurveConfig.generate()


@pytest.fixture(scope="module")
def curve_relay() -> Iterator[RelayFleet]:
    spec = RelaySpec(
        api_key=KEY, curve_public=KEYS.server_public_key, curve_secret=KEYS.server_secret_key
    )
    with RelayFleet([spec]) as fleet:
        yield fleet


def test_only_clients_holding_the_server_key_get_through(
    curve_relay: RelayFleet, api_key: str
) -> None:
    public = KEYS.public_only()
    assert KEYS.server_secret_key is not None
    assert KEYS.server_secret_key.decode() not in repr(KEYS)
    coordinator = RelayCoordinator(api_key=api_key, timeout_s=3.0, tuning=TUNING, curve=public)
    try:
        coordinator.configure_tree(curve_relay.addresses, deadline=Deadline.never())
        trainer = fresh_trainer(coordinator, seed=51, api_key_env_var=KEY_VAR, curve=public)
        before = held_digests(coordinator)
        trainer.step(seed=52)
        payload = next(
            iter(
                trainer.shards[0].tracker.encode(trainer.state, WeightVersion(trainer.version + 1))
            )
        )
        wrong = CurveConfig.generate().public_only()
        cases = (
            (None, AuthenticationError, 5.0),  # fails the handshake: a prompt, typed refusal
            (wrong, (AuthenticationError, RefitTimeoutError), 1.5),  # the relay cannot decrypt it
        )
        for curve, errors, timeout_s in cases:
            client = ZmqSparseRefitClient(
                curve_relay.addresses[0],
                timeout_s=timeout_s,
                producer_id="intruder",
                retries=0,
                api_key=api_key,
                curve=curve,
                tuning=TUNING,
            )
            with client, pytest.raises(errors):
                client.send_payload(
                    transfer_id=new_transfer_id(99),
                    payload_id="0",
                    checksum=payload.checksum,
                    verification_candidates=0,
                    body=payload,
                    deadline=Deadline.never(),
                )
        trainer.shards[0].tracker.abort()
        assert held_digests(coordinator) == before
        status = next(iter(coordinator.status(deadline=Deadline.never()).values()))
        assert isinstance(status, RelayStatus) and status.transfer is None
        trainer.close()
    finally:
        coordinator.close()


def test_keys_load_from_certificate_files_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    public_file, secret_file = zmq.auth.create_certificates(tmp_path, "relay")
    from_file = CurveConfig.from_files(secret_file)
    assert from_file.server_secret_key is not None
    assert CurveConfig.from_files(public_file).server_secret_key is None
    monkeypatch.setenv("REFIT_ZMQ_CURVE_PUBLIC_KEY", from_file.server_public_key.decode())
    assert CurveConfig.from_env() == from_file.public_only()
    monkeypatch.setenv(
        "REFIT_ZMQ_CURVE_SECRET_KEY", CurveConfig.generate().server_secret_key.decode()
    )  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="does not belong"):
        CurveConfig.from_env()
