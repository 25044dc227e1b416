"""Where vLLM's own loaders put each checkpoint tensor inside its live parameters (vllm_direct), found on
meta probes, on the real vLLM (its CPU build, in this process): merged qkv and gate_up runs, a padded
vocabulary's first rows. On the CPU build vLLM repacks linear weights after loading, so an update cannot
land in them: the views are refused with the reason, and updates are staged and reloaded there."""

from __future__ import annotations

import math
import os

import pytest
import torch

from rlsync.transfer.manifest import Spec

pytestmark = pytest.mark.usefixtures("keeps_environ")  # vLLM in this process (conftest)


@pytest.fixture(scope="module")
def vllm_model(tiny_model):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the model in this process (conftest sets it too)
    from vllm import LLM

    llm = LLM(model=str(tiny_model), enforce_eager=True, kv_cache_memory_bytes=64 << 20, max_num_seqs=4)
    yield llm
    del llm


def _specs(tiny_model) -> list[Spec]:
    from rlsync.rollout.engines.checkpoint import checkpoint_tensors

    return [Spec(n, torch.float32, tuple(shape), 4 * math.prod(shape))
            for n, (shape, _) in checkpoint_tensors(str(tiny_model)).items()]


def test_each_tensor_is_one_run_of_the_parameter_vllm_loads_it_into(vllm_model, tiny_model):
    from transformers import AutoConfig

    from rlsync.rollout.engines.vllm_direct import direct_views, placements

    config = AutoConfig.from_pretrained(tiny_model)
    hidden, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * (config.head_dim if getattr(config, "head_dim", None) else
                                      hidden // config.num_attention_heads)
    kv = q // config.num_attention_heads * config.num_key_value_heads
    specs = _specs(tiny_model)

    def probe(model):
        found, why = placements(model, specs)
        return ({n: (p.name, tuple(p.shape), p.offset, p.numel) for n, p in found.items()}, why,
                direct_views(model, specs)[1])

    found, why, refused = vllm_model.apply_model(probe)[0]
    assert why == "" and set(found) == {s.name for s in specs}
    layer = "model.layers.0."
    assert found[layer + "self_attn.q_proj.weight"] == ("weight", (q + 2 * kv, hidden), 0, q * hidden)
    assert found[layer + "self_attn.k_proj.weight"] == ("weight", (q + 2 * kv, hidden), q * hidden, kv * hidden)
    assert found[layer + "self_attn.v_proj.weight"] == ("weight", (q + 2 * kv, hidden), (q + kv) * hidden,
                                                        kv * hidden)
    assert found[layer + "mlp.gate_proj.weight"] == ("weight", (2 * inter, hidden), 0, inter * hidden)
    assert found[layer + "mlp.up_proj.weight"] == ("weight", (2 * inter, hidden), inter * hidden, inter * hidden)
    assert found[layer + "mlp.down_proj.weight"] == ("weight", (hidden, inter), 0, inter * hidden)
    name, shape, offset, numel = found["model.embed_tokens.weight"]
    assert offset == 0 and numel == config.vocab_size * hidden and shape[0] >= config.vocab_size
    assert "cpu" in refused or "processed" in refused, refused


def test_a_tensor_the_loaders_do_not_know_is_no_placement(vllm_model, tiny_model):
    from rlsync.rollout.engines.vllm_direct import placements

    specs = [*_specs(tiny_model), Spec("model.layers.0.mlp.extra.weight", torch.float32, (4, 4), 64)]

    def probe(model):
        try:
            return placements(model, specs)[1]
        except Exception as e:  # noqa: BLE001 - vLLM's own loader may refuse the name first
            return f"refused: {e!r}"

    why = vllm_model.apply_model(probe)[0]
    assert "extra" in why or "refused" in why
