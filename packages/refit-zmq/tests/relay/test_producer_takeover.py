"""A refit that timed out while its producer was still encoding (a starved encoder) leaves
nothing to the next: the next stream stops it and waits for it before it touches the tracker,
commits its own refit, and the refit after that is again a delta."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from relay_helpers import TUNING, digests, make_state, step_state

from refit_core import NamedTensor, RefitTimeoutError
from refit_core.backend import LocalParticipant
from refit_core.sources import StateDictSource
from refit_zmq.relay import ShardProducer, ShardProducerRole, TensorReceiver, ZmqSparseRefitServer
from refit_zmq.sparse import ZmqSparseOptions, ZmqSparseWeightSynchronizer

pytestmark = pytest.mark.timeout(120)


class StarvedPolicy:
    """A trainer whose tensors come out slowly while ``starved`` is set (an encoder starved of
    CPU), and which records how many streams read its tensors at once."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state
        self.starved = threading.Event()
        # Past a 2 s deadline and the grace a refit gives its producers to report after it
        # (DECISION_GRACE_S): the refit fails while the starved stream still runs.
        self.delay_s = 4.0
        self.reading = 0
        self.most_reading = 0
        self._lock = threading.Lock()

    def weight_source(self) -> StarvedPolicy:
        return self

    def state_dict_info(self) -> object:
        return StateDictSource(self.state).state_dict_info()

    def iter_tensors(self) -> Iterator[NamedTensor]:
        with self._lock:
            self.reading += 1
            self.most_reading = max(self.most_reading, self.reading)
        try:
            for name, tensor in self.state.items():
                if self.starved.is_set():
                    time.sleep(self.delay_s)
                yield NamedTensor(name, tensor)
        finally:
            with self._lock:
                self.reading -= 1


def test_the_next_refit_waits_for_a_starved_stream_and_commits_alone() -> None:
    policy = StarvedPolicy(make_state(91))
    relay = ZmqSparseRefitServer(
        TensorReceiver({k: v.clone() for k, v in policy.state.items()}, version=0),
        api_key_env_var=None,
        timeout_s=30.0,
        tuning=TUNING,
    )
    address = relay.start()
    producer = ShardProducer(policy)
    participant = LocalParticipant[ShardProducerRole](producer, "producer 0")
    sync = ZmqSparseWeightSynchronizer(
        [participant],
        lambda: [address],
        refit_timeout_s=30.0,
        options=ZmqSparseOptions(call_timeout_s=5.0, tuning=TUNING),
    )
    try:
        assert sync.sync_weights().version == 1  # a dense resync: no baseline yet
        policy.state = step_state(policy.state, seed=92)
        policy.starved.set()  # its first tensor takes 4 s: the refit fails while it streams
        sync.refit_timeout_s = 2.0
        with pytest.raises(RefitTimeoutError):
            sync.sync_weights()
        assert policy.reading == 1, "the starved stream still runs after its refit failed"
        sync.refit_timeout_s = 30.0
        threading.Timer(1.0, policy.starved.clear).start()  # the encoder gets CPU back
        third = sync.sync_weights()
        assert policy.most_reading == 1, "two refits' streams used the tracker at once"
        assert (
            producer.tracker.version is not None and producer.tracker.version.value == third.version
        )
        assert relay.status(digests=True).digests == digests(policy.state)
        policy.state = step_state(policy.state, seed=93)
        fourth = sync.sync_weights()
        assert fourth.wire_bytes < fourth.dense_bytes / 10, "the refit after it was not a delta"
        assert relay.status(digests=True).digests == digests(policy.state)
    finally:
        sync.shutdown()
        relay.close()
