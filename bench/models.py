"""State-dict shapes of real model families, for benchmarks (no weights: shapes only)."""

from __future__ import annotations


def decoder_shapes(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                   vocab: int, tied: bool) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (intermediate, hidden),
            p + "mlp.up_proj.weight": (intermediate, hidden),
            p + "mlp.down_proj.weight": (hidden, intermediate),
        }
    shapes["model.norm.weight"] = (hidden,)
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    return shapes


PRESETS = {
    # Qwen3-4B layout with an untied head: 8.8 GB in bf16 (the size the environment facts quote).
    "qwen3-4b": dict(hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728,
                     vocab=151936, tied=False),
    "qwen3-1.7b": dict(hidden=2048, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=6144,
                       vocab=151936, tied=True),
    # Qwen3-1.7B's 310 tensors at a few KB each: on a CPU, a routed update's fixed per-update work
    # (roster, plan, layouts, export) is then most of its time (bench/sharded.py).
    "qwen3-1.7b-tiny": dict(hidden=64, layers=28, heads=2, kv_heads=1, head_dim=32, intermediate=128, vocab=512,
                            tied=True),
    "small": dict(hidden=512, layers=4, heads=8, kv_heads=4, head_dim=64, intermediate=1536, vocab=32000,
                  tied=False),
}


def preset_shapes(name: str) -> dict[str, tuple[int, ...]]:
    return decoder_shapes(**PRESETS[name])
