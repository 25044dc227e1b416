"""The hf engine driven directly (no gRPC): batched decoding must match transformers' own greedy decoding."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlsync.errors import InvalidArgument
from rlsync.rollout.engines.hf import HFEngine
from rlsync.rollout.types import FinishReason, GenerationRequest, PauseMode, SamplingParams

PROMPTS = [[5, 6, 7], [100, 200, 300, 400, 17, 18, 19, 20], [42], [7, 7, 7, 7, 7]]


async def _run(engine: HFEngine, request: GenerationRequest) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    async for d in engine.generate(request):
        out.setdefault(d.index, []).extend(d.token_ids)
    return out


@pytest.mark.parametrize("args", [{}, {"arm_while_generating": True}])  # (the latter: each step and command timed)
def test_batched_greedy_equals_transformers_generate(tiny_model, args):
    model = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    expected = []
    for p in PROMPTS:
        ids = model.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, min_new_tokens=20,
                             pad_token_id=0)
        expected.append(ids[0, len(p):].tolist())

    async def main():
        # max_num_seqs=3 < 4 prompts: sequences join and leave the batch while others decode.
        engine = HFEngine(str(tiny_model), {"max_num_seqs": 3, **args})
        await engine.start()
        try:
            sampling = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
            results = await asyncio.gather(*(_run(engine, GenerationRequest(f"r{i}", tuple(p), sampling))
                                             for i, p in enumerate(PROMPTS)))
        finally:
            await engine.shutdown()
        return [r[0] for r in results]

    assert asyncio.run(main()) == expected


def test_pause_keep_then_abort_ends_frozen_sequences(tiny_model):
    async def main():
        engine = HFEngine(str(tiny_model), {})
        await engine.start()
        try:
            request = GenerationRequest("frozen", (1, 2, 3), SamplingParams(max_tokens=900, ignore_eos=True, n=2))
            deltas = []

            async def consume():
                async for d in engine.generate(request):
                    deltas.append(d)

            task = asyncio.create_task(consume())
            while not deltas:
                await asyncio.sleep(0.01)
            await engine.pause(PauseMode.KEEP)
            await engine.pause(PauseMode.ABORT)
            await asyncio.wait_for(task, 10)
            finals = [d for d in deltas if d.finish is not None]
            assert sorted(d.index for d in finals) == [0, 1]
            assert all(d.finish is FinishReason.ABORT for d in finals)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_unknown_engine_argument_is_refused(tiny_model):
    with pytest.raises(InvalidArgument, match="unknown hf engine argument.*bogus.*valid: arm, arm_patience_ms, arm_w"):
        HFEngine(str(tiny_model), {"bogus": 1})


@pytest.mark.parametrize("raw, why", [({"arm": "yes"}, "arm must be true or false"),
                                      ({"arm_while_generating": 1}, "arm_while_generating must be true or false"),
                                      ({"arm": False, "arm_while_generating": True}, "needs arm: true"),
                                      ({"arm_patience_ms": 0}, "arm_patience_ms must be > 0, got 0"),
                                      ({"arm_patience_ms": "1"}, "arm_patience_ms must be > 0, got '1'"),
                                      ({"arm_patience_ms": True}, "arm_patience_ms must be > 0, got True"),
                                      ({"arm_patience_ms": float("inf")}, "arm_patience_ms must be > 0, got inf"),
                                      ({"switch_interval_ms": 0}, "switch_interval_ms must be > 0")])
def test_a_bad_engine_argument_value_is_refused(tiny_model, raw, why):
    with pytest.raises(InvalidArgument, match=why):
        HFEngine(str(tiny_model), raw)


def test_an_idle_engine_lends_its_turn_and_a_busy_one_runs_the_command_between_steps(tiny_model):
    """The update's steps run in the caller's thread while the engine idles (no hop there and
    back), and on the engine thread while it decodes; either way no step runs beside them."""
    async def main():
        engine = HFEngine(str(tiny_model), {})
        await engine.start()
        try:
            while not engine._idle:  # the thread has started and waits for work
                await asyncio.sleep(0.001)
            steps = []

            def command() -> str:  # a request queued meanwhile must not step while this runs
                engine._call(lambda: steps.append("queued"))
                threading.Event().wait(0.05)
                steps.append("command")
                return threading.current_thread().name

            idle = await engine._soon(command)
            await engine.memory()  # the queued command ran after the lent turn
            request = GenerationRequest("long", (1, 2, 3), SamplingParams(max_tokens=1000, ignore_eos=True))
            task = asyncio.create_task(_run(engine, request))
            while not engine.batch:
                await asyncio.sleep(0.01)
            busy = await engine._soon(lambda: threading.current_thread().name)
            await engine.abort("long")
            await task
            return idle, steps, busy
        finally:
            await engine.shutdown()

    idle, steps, busy = asyncio.run(main())
    assert idle == threading.main_thread().name and steps == ["command", "queued"]
    assert busy == "hf-engine"


def test_a_caller_that_gives_up_while_its_command_waits_leaves_the_engine_serving(tiny_model):
    """A gRPC call the coordinator abandons (a member it dropped) cancels the engine command it awaits: the
    command still runs on the engine thread, whose hand-over of the result then finds nobody waiting. The
    engine thread goes on (it died of InvalidStateError, and every later call hung) and serves the next
    request."""
    async def main():
        engine = HFEngine(str(tiny_model), {})
        await engine.start()
        try:
            started, release = threading.Event(), threading.Event()
            blocker = asyncio.ensure_future(engine._call(lambda: (started.set(), release.wait(10))))
            await asyncio.to_thread(started.wait, 10)
            waiting = asyncio.ensure_future(engine._call(lambda: "nobody reads this"))
            await asyncio.sleep(0)
            waiting.cancel()  # queued behind the blocker, cancelled before it runs
            blocker.cancel()  # cancelled while it runs
            release.set()
            sampling = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            return await asyncio.wait_for(_run(engine, GenerationRequest("after", (5, 6, 7), sampling)), 60)
        finally:
            await engine.shutdown()

    assert len(asyncio.run(main())[0]) == 4
