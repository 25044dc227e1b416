"""The hf engine's steps on a real-size model: a decode step of `--rows` running sequences, and the
same step when prompts join (one forward either way). The figure is a join's cost against a plain
decode step: a stream's token gap when someone joins. Prints one JSON object.

    python bench/hf_steps.py --preset qwen3-1.7b --rows 32 --context 256 --prompt 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rlsync.models import build_preset, resolve_model
from rlsync.rollout.engines.hf_batch import Batch, Sequence
from rlsync.rollout.types import SamplingParams


def timed(fn) -> float:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-1.7b")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--context", type=int, default=256, help="tokens each running sequence has")
    parser.add_argument("--prompt", type=int, default=8, help="tokens of a joining prompt")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--model", default=None, help="a local model instead of the preset (`tiny`: the built-in one)")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    folder = resolve_model(args.model) if args.model else \
        build_preset(Path(tempfile.gettempdir()) / f"rlsync-{args.preset}", args.preset, device=device.type)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    batch = Batch(model, device)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(1, vocab, (n,), generator=gen).tolist()  # noqa: E731

    def seat(prompts: list[list[int]], logits: torch.Tensor) -> list[Sequence]:
        seqs = []
        for i, (prompt, row) in enumerate(zip(prompts, logits)):
            seq = Sequence("r", 0, prompt, SamplingParams(), None, None, None)
            seq.output, seq.next_token = [int(row.argmax())], int(row.argmax())
            batch.join(i, [seq])
            seqs.append(seq)
        return seqs

    def advance(logits: torch.Tensor) -> None:
        for seq, token in zip(batch.seqs, logits.argmax(-1).tolist()):
            seq.output.append(token)
            seq.next_token = token

    prompts = [tokens(args.context) for _ in range(args.rows)]
    seat(prompts, batch.step(prompts)[1])

    def decode() -> None:
        advance(batch.step([])[0])

    def join(n: int) -> None:
        """n prompts join, and leave again (from the tail: no row moves), keeping the batch as it was."""
        prompts = [tokens(args.prompt) for _ in range(n)]
        running, first = batch.step(prompts)
        advance(running)
        batch.remove(set(seat(prompts, first)))

    def after_leave() -> float:
        """The step after a running sequence left: the last row moves into its place. Then one of
        the same length joins (untimed), keeping the batch as it was."""
        leaving = batch.seqs[int(torch.randint(len(batch) - 1, (1,), generator=gen))]
        batch.remove({leaving})
        took = timed(decode)
        prompt = tokens(leaving.length)
        running, first = batch.step([prompt])
        advance(running)
        seat([prompt], first)
        return took

    for _ in range(5):
        decode()
        join(1)
        after_leave()
    out = {"model": args.model or args.preset, "rows": args.rows, "context": args.context, "prompt": args.prompt,
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    times = {"decode": [], "join_1": [], "join_4": [], "after_leave": []}
    for _ in range(args.steps):
        times["decode"].append(timed(decode))
        times["join_1"].append(timed(lambda: join(1)))
        times["join_4"].append(timed(lambda: join(4)))
        times["after_leave"].append(after_leave())
    median = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out |= {f"{k}_ms": round(v, 3) for k, v in median.items()}
    out |= {f"{k}_max_ms": round(max(v) * 1e3, 3) for k, v in times.items()}
    out |= {f"{k}_vs_decode": round(v / median["decode"], 3) for k, v in median.items() if k != "decode"}
    out["recompute_ms"] = round(statistics.median(timed(batch.recompute) for _ in range(5)) * 1e3, 3)
    out["kv_cache_gib"] = round(batch.kv_bytes() / (1 << 30), 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
