"""The FP8 format an engine declares (from its quantization config and checkpoint), and the publishing
stage that quantizes a source to it: names, order, dtypes, bytes, and the errors."""

from __future__ import annotations

import pytest
import torch

from rlsync.errors import FailedPrecondition, InvalidArgument
from rlsync.publish.quantized import quantized
from rlsync.quant.fp8_blocks import quantize_blocks
from rlsync.quant.fp8_format import describe, fp8_format, parse_fp8, same_format
from rlsync.transfer.source import ResidentSource
from rlsync.transfer.v1 import transfer_pb2 as pb

CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
LINEARS = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate.weight",
           "model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight", "lm_head.weight"]


def test_the_config_decides_which_linears_are_fp8_and_routers_and_head_never_are():
    fmt = fp8_format({**CONFIG, "modules_to_not_convert": ["model.layers.1"]}, LINEARS)
    assert list(fmt.fp8.weights) == ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"]
    assert list(fmt.fp8.block) == [128, 128] and fmt.fp8.scale_dtype == "float32" and not fmt.fp8.pow2_scales
    assert "2 weights" in describe(fmt) and describe(None) == "unquantized"


def test_a_prequantized_checkpoint_says_itself_which_weights_are_fp8():
    names = {"model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight_scale_inv"}
    assert list(fp8_format(CONFIG, LINEARS, names).fp8.weights) == ["model.layers.0.mlp.down_proj.weight"]


def test_configs_rlsync_cannot_send_exactly_are_refused_saying_why():
    with pytest.raises(InvalidArgument, match="only e4m3"):
        parse_fp8({**CONFIG, "fmt": "e5m2"})
    with pytest.raises(InvalidArgument, match="one scale per tensor"):
        parse_fp8({"quant_method": "fp8"})
    with pytest.raises(InvalidArgument, match="not an FP8"):
        parse_fp8({"quant_method": "awq"})
    assert parse_fp8({**CONFIG, "scale_fmt": "ue8m0"}).pow2_scales


def test_a_fleet_of_two_formats_is_refused_naming_the_replicas():
    from rlsync.coordinator.registry import Member
    from rlsync.coordinator.sync import weight_format

    fmt = fp8_format(CONFIG, LINEARS)
    a, b = (Member(n, 1, "x", n, None) for n in ("fp8-replica", "bf16-replica"))
    a.weight_format = fmt
    assert same_format(weight_format([a]), fmt) and weight_format([b]) is None
    with pytest.raises(FailedPrecondition, match="fp8-replica: fp8 e4m3.*bf16-replica: unquantized"):
        weight_format([a, b])


def test_fused_experts_go_out_stacked_only_where_every_replica_takes_them_so():
    from rlsync.coordinator.registry import Member
    from rlsync.coordinator.sync import weight_format
    from rlsync.quant.fp8_format import stacked

    vllm, sglang, other = (Member(n, 1, "x", n, None) for n in ("vllm", "sglang", "vllm-2"))
    vllm.weight_format = other.weight_format = pb.WeightFormat(stacked_experts=True)
    assert stacked(weight_format([vllm, other]))
    assert weight_format([vllm, sglang]) is None and weight_format([sglang, vllm]) is None
    assert same_format(weight_format([vllm]), None), "stacking is a way of sending, not a format"
    assert not stacked(pb.WeightFormat(stacked_experts=True, fp8=fp8_format(CONFIG, LINEARS).fp8))


def test_the_stage_sends_each_listed_weight_as_fp8_then_its_scales_and_the_rest_as_is():
    torch.manual_seed(0)
    tensors = {"embed.weight": torch.randn(10, 8, dtype=torch.bfloat16),
               "model.layers.0.mlp.down_proj.weight": torch.randn(300, 130, dtype=torch.bfloat16),
               "norm.weight": torch.randn(8, dtype=torch.bfloat16)}
    fmt = fp8_format(CONFIG, ["model.layers.0.mlp.down_proj.weight"])
    source = quantized(ResidentSource(tensors), fmt)
    specs = source.specs()
    assert [(s.name, s.dtype, s.shape) for s in specs] == [
        ("embed.weight", torch.bfloat16, (10, 8)),
        ("model.layers.0.mlp.down_proj.weight", torch.float8_e4m3fn, (300, 130)),
        ("model.layers.0.mlp.down_proj.weight_scale_inv", torch.float32, (3, 2)),
        ("norm.weight", torch.bfloat16, (8,))]
    got = dict(source.items())
    q, s = quantize_blocks(tensors["model.layers.0.mlp.down_proj.weight"])
    assert torch.equal(got["model.layers.0.mlp.down_proj.weight"].view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(got["model.layers.0.mlp.down_proj.weight_scale_inv"], s)
    assert torch.equal(got["embed.weight"], tensors["embed.weight"])
    assert source.format is fmt and "norm.weight" not in source.quantized


def test_the_stage_refuses_weights_it_cannot_quantize():
    fmt = fp8_format(CONFIG, ["w", "missing"])
    with pytest.raises(InvalidArgument, match="does not publish: \\['missing'\\]"):
        quantized(ResidentSource({"w": torch.zeros(4, 4)}), fmt)
    with pytest.raises(InvalidArgument, match="only 2-D floating-point"):
        quantized(ResidentSource({"w": torch.zeros(4), "missing": torch.zeros(2, 2)}), fmt)


def test_vllm_and_sglang_refuse_fp8_models_on_cpus_without_amx(tmp_path):
    import json

    from rlsync.checks import StartupError
    from rlsync.rollout.engines.fp8_support import refuse_fp8_on_cpu

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": CONFIG}))
    for engine in ("vllm", "sglang"):
        with pytest.raises(StartupError, match=f"{engine} cannot serve the FP8 model .* needs AMX"):
            refuse_fp8_on_cpu(engine, str(tmp_path), on_cpu=True, amx=False)
        refuse_fp8_on_cpu(engine, str(tmp_path), on_cpu=True, amx=True)  # may serve: its own start decides
        refuse_fp8_on_cpu(engine, str(tmp_path), on_cpu=False, amx=False)  # a GPU serves it
    refuse_fp8_on_cpu("hf", str(tmp_path), on_cpu=True, amx=False)  # dequantizes per block


def test_an_engine_loading_the_checkpoint_as_is_declares_the_format_the_hf_engine_finds():
    """vLLM (on a GPU) holds a pre-quantized checkpoint's FP8 weights as they are: its format comes from the
    checkpoint alone and names the weights the hf engine finds in its model."""
    from transformers import AutoModelForCausalLM

    from rlsync.models import ensure_tiny_fp8, ensure_tiny_model
    from rlsync.rollout.engines.fp8_support import checkpoint_format
    from rlsync.rollout.engines.hf_fp8 import to_fp8

    path = str(ensure_tiny_fp8())
    fmt = checkpoint_format(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    found = to_fp8(model, path)
    assert sorted(fmt.fp8.weights) == sorted(found.fp8.weights) and len(fmt.fp8.weights) == 14
    assert list(fmt.fp8.block) == [128, 128] and fmt.fp8.scale_dtype == "float32"
    assert checkpoint_format(str(ensure_tiny_model())) is None
