"""rlsync's own record of which weight version made which tokens (what every vLLM replica keeps: the workers'
counts of each request's sampled tokens, vllm_versions.TokenCounts) against vLLM 0.32's own per-token labels, in
one run of the real engine (its CPU build, in this process). vLLM's labels are exact only across a pause (it
attaches them to a step's outputs when they are read), so the switches here are taken while generation is
paused between two steps; a commit reads the same counts between two steps without one. Both records must split
every completion at the same token; so must the output processor's count, what a replica whose workers cannot
count exactly reads under its pause."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here (a GPU machine before its parts)")

from conftest import VLLM_TEST_ARGS
from rlsync.rollout.engines.vllm_versions import SwitchPoints

TOKENS, N, SWITCHES = 160, 2, (7, 8)
pytestmark = pytest.mark.usefixtures("keeps_environ")  # vLLM in this process (conftest)


def test_switch_points_split_completions_where_vllm_labels_change(tiny_model):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from rlsync.rollout.engines.vllm import VLLMEngine

    async def run():
        engine = VLLMEngine(str(tiny_model), dict(VLLM_TEST_ARGS))
        await engine.start()
        try:
            assert engine._counted, "the CPU build's workers count each request's tokens"
            finals, produced = {}, {}
            await engine.llm.update_weight_version("0")  # (vLLM's labels: "default" until set)

            async def stream(request_id: str):  # (vLLM's own API: its labels are the reference)
                params = SamplingParams(max_tokens=TOKENS, n=N, ignore_eos=True, seed=1,
                                        output_kind=RequestOutputKind.DELTA)
                async for out in engine.llm.generate(TokensPrompt(prompt_token_ids=[5, 6, 7, 8]), params, request_id):
                    for c in out.outputs:
                        produced[request_id] = produced.get(request_id, 0) + len(c.token_ids)
                        if c.finish_reason is not None:
                            finals[(request_id, c.index)] = [(int(s.version), s.start, s.end - s.start)
                                                             for s in c.weight_versions if s.end > s.start]

            tasks = [asyncio.create_task(stream(f"s{i}")) for i in range(3)]
            points = {f"s{i}": SwitchPoints(0, N) for i in range(3)}
            for version in SWITCHES:
                while sum(produced.values()) < 40 * (version - SWITCHES[0] + 1):  # tokens before each switch
                    await asyncio.sleep(0.01)
                await engine.llm.pause_generation(mode="keep", clear_cache=False)
                counted = engine._by_request((await engine.llm.collective_rpc("rlsync_tokens"))[0])
                assert counted == await engine._produced(), "the workers' count and the output processor's differ"
                assert set(counted) == set(points) and all(len(c) == N for c in counted.values())
                for request_id, counts in counted.items():
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
