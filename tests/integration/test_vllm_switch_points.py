"""rlsync's own record of which weight version made which tokens (what a vLLM 0.20 replica keeps, where vLLM
keeps none) against vLLM 0.32's own record, in one run of the real engine (its CPU build, in this process):
switch points read from vLLM's output processor while generation is paused between two steps split every
completion exactly where vLLM's per-token labels change."""

from __future__ import annotations

import asyncio

import pytest

from conftest import VLLM_TEST_ARGS
from rlsync.rollout.engines.vllm_versions import SwitchPoints
from rlsync.rollout.types import GenerationRequest, SamplingParams

TOKENS, N, SWITCHES = 160, 2, (7, 8)
pytestmark = pytest.mark.usefixtures("keeps_environ")  # vLLM in this process (conftest)


def test_switch_points_split_completions_where_vllm_labels_change(tiny_model):
    from rlsync.rollout.engines.vllm import VLLMEngine

    async def run():
        engine = VLLMEngine(str(tiny_model), dict(VLLM_TEST_ARGS))
        await engine.start()
        try:
            assert engine._tags, "vLLM 0.32 labels tokens itself: the reference this test needs"
            finals, produced = {}, {}

            async def stream(request_id: str):
                request = GenerationRequest(request_id, (5, 6, 7, 8), SamplingParams(max_tokens=TOKENS, n=N,
                                                                                      ignore_eos=True, seed=1))
                async for delta in engine.generate(request):
                    produced[request_id] = produced.get(request_id, 0) + len(delta.token_ids)
                    if delta.finish is not None:
                        finals[(request_id, delta.index)] = delta.spans

            tasks = [asyncio.create_task(stream(f"s{i}")) for i in range(3)]
            points = {f"s{i}": SwitchPoints(0) for i in range(3)}
            for version in SWITCHES:
                while sum(produced.values()) < 40 * (version - SWITCHES[0] + 1):  # tokens before each switch
                    await asyncio.sleep(0.01)
                await engine.llm.pause_generation(mode="keep", clear_cache=False)
                for request_id, counts in (await engine._produced()).items():
                    for index, count in counts.items():
                        points[request_id].switch(index, count, version)
                await engine.llm.update_weight_version(str(version))  # vLLM's own labels from here on
                await engine.llm.resume_generation()
            await asyncio.gather(*tasks)
            return finals, points
        finally:
            await engine.shutdown()

    finals, points = asyncio.run(run())
    assert len(finals) == 3 * N
    for (request_id, index), vllms in finals.items():
        assert sum(n for _, _, n in vllms) == TOKENS
        assert points[request_id].spans(index, TOKENS) == vllms, (request_id, index)
    assert any(len(spans) > 1 for spans in finals.values()), "the switches fell inside the streams"
