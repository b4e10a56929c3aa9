"""``refit relay serve``'s options: every ``RelayTuning`` field, its default shown, bad values
refused in one line; a relay started with them admits and queues as they say (plain pyzmq)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
from relay_helpers import start_launched
from wire_helpers import Wire

from refit_zmq.relay import RelayTuning, new_transfer_id
from refit_zmq.relay_cli import main

pytestmark = pytest.mark.timeout(180)


def test_serve_takes_every_tuning_field_and_shows_its_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    assert exited.value.code == 0
    options = " ".join(capsys.readouterr().out.split()).split("options:")[1]

    def default(flag: str) -> str:
        found = re.search(rf"{flag} [A-Z_]+ .*?\(default: ([^)]*)\)", options)
        assert found is not None, flag
        return found[1]

    for option in dataclasses.fields(RelayTuning):
        assert default(f"--{option.name.replace('_', '-')}") == str(option.default)
    assert default("--timeout-s") == "30.0"


def test_protocol_md_states_the_relays_defaults() -> None:
    text = " ".join((Path(__file__).parents[2] / "PROTOCOL.md").read_text().split())
    tuning = RelayTuning()
    for name in ("fanout", "window_payloads", "max_pending_admissions", "hwm_messages"):
        assert re.search(rf"`{name}` {getattr(tuning, name)}\b", text), name
    assert f"`chunk_bytes` {tuning.chunk_bytes >> 20} MiB" in text
    assert f"`max_inflight_bytes` {tuning.max_inflight_bytes >> 20} MiB" in text


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (["--chunk-bytes", "100"], "chunk_bytes >= 4096"),
        (["--window-payloads", "0"], "must be >= 1"),
        (["--shapes", "w=4:nodtype"], "bad tensor spec"),
    ],
)
def test_a_refused_value_ends_in_one_line_not_a_traceback(
    capsys: pytest.CaptureFixture[str], options: list[str], says: str
) -> None:
    assert main(["serve", "--shapes", "w=4:float32", *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith("refit relay serve: ") and says in err, err
    assert "Traceback" not in err and err.count("\n") == 1


def _begin(transfer_id: str, payload_id: str) -> dict[str, object]:
    return {
        "transfer_id": transfer_id,
        "producer_id": "p",
        "payload_id": payload_id,
        "checksum": "0" * 32,
        "total_bytes": 64,
        "verification_candidates": 0,
        "base": 0,
        "target": 1,
        "deadline_s": 30.0,
    }


def test_a_relay_admits_and_queues_as_its_options_say() -> None:
    relay = start_launched(
        [
            "serve",
            "--shapes",
            "w=64:float32",
            "--window-payloads",
            "1",
            "--max-pending-admissions",
            "1",
        ]
    )
    try:
        with Wire(relay.address) as wire:
            transfer_id = new_transfer_id(1)
            kinds = []
            for payload_id in "012":
                wire.send("BEGIN", **_begin(transfer_id, payload_id))
                reply = wire.reply()
                kinds.append(reply.get("code", reply["kind"]))
        assert kinds == ["READY", "QUEUED", "BUSY"]  # window of 1, queue of 1
    finally:
        relay.close()
