"""The embedded default model: a tiny Qwen2 built locally and deterministically, cached once per machine.

No download is ever needed: the tokenizer is a byte-level BPE trained on generated text, the weights
are a seeded random init. `resolve_model("tiny")` builds it on first use (concurrent callers wait).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

TINY = "tiny"
TINY_MOE = "tiny-moe"
TINY_FP8 = "tiny-fp8"
ARCHS = {"qwen2": TINY, "qwen3-moe": TINY_MOE, "qwen3-fp8": TINY_FP8}  # make-tiny-model --arch
EOS = "<|endoftext|>"
# Plain-text turns (the tiny vocabulary has no role tokens); a turn ends with EOS as the model's do.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


class _Recipe:
    """A recipe's fields determine the model's bytes: their hash names its cache folder."""

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


@dataclass(frozen=True)
class TinyRecipe(_Recipe):
    """Everything that determines the tiny model's bytes; its hash names the cache folder."""

    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32  # vLLM's CPU attention rejects head_dim 16
    intermediate_size: int = 384
    vocab_size: int = 512
    max_position_embeddings: int = 1024
    seed: int = 0
    corpus_lines: int = 4000
    version: int = 2  # 2: a chat template


def cache_dir() -> Path:
    return Path(os.environ.get("RLSYNC_CACHE", Path.home() / ".cache" / "rlsync"))


def _corpus(n: int, seed: int) -> list[str]:
    """Generated text with words, numbers and arithmetic: enough variety for a useful BPE."""
    rng = random.Random(seed)
    words = ("the model reads a token and writes the next one while weights move from trainer "
             "to engine every step reward is high when the answer is right sum of two numbers "
             "count letters alpha beta gamma delta yes no true false").split()
    lines = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.4:
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))))
        elif kind < 0.7:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            lines.append(f"{a}+{b}={a + b}")
        else:
            lines.append(" ".join(str(rng.randint(0, 9999)) for _ in range(rng.randint(2, 8))))
    return lines


def build_tiny_model(out: Path, recipe: TinyRecipe = TinyRecipe()) -> Path:
    """Writes config, safetensors weights and tokenizer into `out` (a new folder)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=recipe.vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(_corpus(recipe.corpus_lines, recipe.seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    tokenizer.chat_template = CHAT_TEMPLATE
    eos_id = tokenizer.convert_tokens_to_ids(EOS)

    config = Qwen2Config(
        vocab_size=recipe.vocab_size, hidden_size=recipe.hidden_size,
        intermediate_size=recipe.intermediate_size, num_hidden_layers=recipe.num_hidden_layers,
        num_attention_heads=recipe.num_attention_heads, num_key_value_heads=recipe.num_key_value_heads,
        head_dim=recipe.head_dim, max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=True, bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
        torch_dtype="float32",
    )
    torch.manual_seed(recipe.seed)
    model = Qwen2ForCausalLM(config)
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "rlsync_recipe.json").write_text(json.dumps(asdict(recipe), indent=2))
    return out


def ensure_tiny_model(recipe: TinyRecipe = TinyRecipe()) -> Path:
    """The cached tiny model's folder, building it first if needed (safe across processes)."""
    return _cached(f"tiny-qwen2-{recipe.key()}", lambda out: build_tiny_model(out, recipe))


def _cached(folder: str, build) -> Path:
    root = cache_dir() / "models"
    target = root / folder
    if (target / "rlsync_recipe.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "rlsync_recipe.json").exists():
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=".build-"))
            try:
                build(tmp / "model")
                (tmp / "model").rename(target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


@dataclass(frozen=True)
class TinyMoeRecipe(_Recipe):
    """The tiny mixture of experts (a Qwen3-MoE): the tiny model's tokenizer, 8 experts, 2 per token."""

    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32  # vLLM's CPU attention rejects head_dim 16
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    intermediate_size: int = 64
    max_position_embeddings: int = 1024
    seed: int = 0
    tokenizer: str = TinyRecipe().key()  # the dense tiny model whose tokenizer it shares
    version: int = 1


def build_tiny_moe(out: Path, recipe: TinyMoeRecipe = TinyMoeRecipe()) -> Path:
    """Writes config, safetensors weights (per expert, as transformers saves them) and the tiny tokenizer."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    dense = ensure_tiny_model()
    base = json.loads((dense / "config.json").read_text())
    eos = base["eos_token_id"]
    fields = {k: v for k, v in asdict(recipe).items() if k not in ("seed", "tokenizer", "version")}
    config = Qwen3MoeConfig(**fields, vocab_size=base["vocab_size"], tie_word_embeddings=False,
                            bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, torch_dtype="float32")
    torch.manual_seed(recipe.seed)
    model = Qwen3MoeForCausalLM(config)
    out.mkdir(parents=True)
    model.save_pretrained(out, safe_serialization=True)
    return _finish(out, dense, recipe)


def _finish(out: Path, dense: Path, recipe: _Recipe) -> Path:
    """Copies the dense tiny model's tokenizer files (and its chat template) beside a model, and its recipe."""
    for f in dense.iterdir():
        if f.name not in ("config.json", "generation_config.json", "rlsync_recipe.json") and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    (out / "rlsync_recipe.json").write_text(json.dumps(asdict(recipe), indent=2))
    return out


def ensure_tiny_moe(recipe: TinyMoeRecipe = TinyMoeRecipe()) -> Path:
    """The cached tiny MoE model's folder, building it first if needed (safe across processes)."""
    ensure_tiny_model()  # its tokenizer first (the same lock)
    return _cached(f"tiny-qwen3-moe-{recipe.key()}", lambda out: build_tiny_moe(out, recipe))


@dataclass(frozen=True)
class TinyFp8Recipe(_Recipe):
    """A tiny Qwen3 whose linear layers are block FP8 (e4m3, 128 x 128 blocks, fp32 weight_scale_inv), as
    DeepSeek-V3 / Kimi-K2 checkpoints are: every linear dimension a multiple of 128 (transformers'
    dequantization on CPU needs whole blocks); embeddings, norms and the (tied) head stay bf16."""

    hidden_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 256
    max_position_embeddings: int = 1024
    seed: int = 0
    tokenizer: str = TinyRecipe().key()
    version: int = 2  # 2: config.json names its architecture (vLLM reads no generating model without it)


FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def build_tiny_fp8(out: Path, recipe: TinyFp8Recipe = TinyFp8Recipe()) -> Path:
    """Writes an FP8 checkpoint (quantized by rlsync.quant, vLLM's reference bits) and the tiny tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rlsync.quant.fp8_blocks import quantize_blocks

    dense = ensure_tiny_model()
    base = json.loads((dense / "config.json").read_text())
    eos = base["eos_token_id"]
    fields = {k: v for k, v in asdict(recipe).items() if k not in ("seed", "tokenizer", "version")}
    config = Qwen3Config(**fields, vocab_size=base["vocab_size"], tie_word_embeddings=True, bos_token_id=eos,
                         eos_token_id=eos, pad_token_id=eos, torch_dtype="bfloat16")
    torch.manual_seed(recipe.seed)
    model = Qwen3ForCausalLM(config).to(torch.bfloat16)
    linears = {f"{n}.weight" for n, m in model.model.layers.named_modules(prefix="model.layers")
               if isinstance(m, torch.nn.Linear)}
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":  # tied to the embedding
            continue
        if name in linears:
            tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(t)
        else:
            tensors[name] = t.contiguous()
    out.mkdir(parents=True)
    config.quantization_config = dict(FP8_CONFIG)
    config.architectures = [type(model).__name__]  # model.save_pretrained writes it; config.save_pretrained does not
    config.save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return _finish(out, dense, recipe)


def ensure_tiny_fp8(recipe: TinyFp8Recipe = TinyFp8Recipe()) -> Path:
    """The cached tiny FP8 model's folder, building it first if needed (safe across processes)."""
    ensure_tiny_model()
    return _cached(f"tiny-qwen3-fp8-{recipe.key()}", lambda out: build_tiny_fp8(out, recipe))


MODEL_DTYPES = ("float32", "bfloat16", "float16")


def torch_dtype(name: str):
    """A parameter dtype option as `from_pretrained` takes it: "auto" (the checkpoint's) or a torch dtype."""
    if name == "auto":
        return "auto"
    if name not in MODEL_DTYPES:
        raise ValueError(f"unsupported dtype {name!r}: choose auto, {', '.join(MODEL_DTYPES)}")
    import torch

    return getattr(torch, name)


def load_trainable(path: str, dtype: str = "auto"):
    """The causal LM at `path` (on CPU) with trainable weights in `dtype`: a block-FP8 checkpoint's
    dequantized, wherever it loads (transformers keeps them FP8, which no optimizer steps, whenever a
    GPU is present; without one it dequantizes them itself)."""
    from transformers import AutoModelForCausalLM

    from rlsync.quant.fp8_format import is_fp8_config, quantization_config

    extra = {}
    if is_fp8_config(quantization_config(path)):
        from transformers import FineGrainedFP8Config

        extra["quantization_config"] = FineGrainedFP8Config(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype), **extra)


def resolve_model(name: str) -> str:
    """`tiny` -> the locally built default, `tiny-moe` -> its mixture of experts, `tiny-fp8` -> a tiny
    Qwen3 in block FP8; anything else is a local path (or a hub id, offline)."""
    if name == TINY:
        return str(ensure_tiny_model())
    if name == TINY_MOE:
        return str(ensure_tiny_moe())
    if name == TINY_FP8:
        return str(ensure_tiny_fp8())
    return name


# Real model families' shapes with random weights, for GPU benchmarks (tokenizer: the tiny one's;
# ids it does not know decode to nothing, which generation does not mind).
PRESETS = {
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=4096,
                       tie_word_embeddings=True),
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=4096,
                     tie_word_embeddings=True),
}


def build_preset(out: Path, preset: str, device: str = "cpu", dtype: str = "bfloat16", seed: int = 0) -> Path:
    """A Qwen3 model of a real size with random weights, written like a checkpoint."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (out / "config.json").exists():
        return out
    tiny = ensure_tiny_model()
    eos = json.loads((tiny / "config.json").read_text())["eos_token_id"]
    config = Qwen3Config(**PRESETS[preset], bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, torch_dtype=dtype)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, out / name)
    # Written back now (GBs of dirty pages), not beside what a benchmark times next (the kernel's writeback
    # threads take CPU the services' control paths need; suspected, not shown, in two slow in-flight runs).
    os.sync()
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="rlsync make-tiny-model", description=__doc__)
    parser.add_argument("--arch", choices=sorted(ARCHS), default="qwen2",
                        help="the tiny model's architecture: a dense Qwen2 (default), a Qwen3 mixture of experts, "
                             "or a Qwen3 with block-FP8 linear layers (qwen3-fp8)")
    parser.add_argument("--model", choices=sorted(ARCHS.values()), help="the same by its model name (tiny-fp8, ...)")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="instead: a real-size model with random weights")
    parser.add_argument("--out", help="folder for --preset")
    parser.add_argument("--device", default="cpu", help="where --preset initializes its weights")
    args = parser.parse_args(argv)
    if args.preset:
        if not args.out:
            parser.error("--preset needs --out")
        print(build_preset(Path(args.out), args.preset, args.device))
    else:
        print(resolve_model(args.model or ARCHS[args.arch]))
    return 0
