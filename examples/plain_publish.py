"""Bring your own trainer: a plain Hugging Face + PyTorch RL loop (its own optimizer, its own loss)
that generates through the fleet and publishes its weights after every step.

Start a coordinator and a replica (no rlsync trainer: this script is the trainer), then:

    python examples/plain_publish.py --coordinator 127.0.0.1:50050

Each step: sample 8 completions per prompt through the coordinator's gateway, reward digits, take a
REINFORCE step with a group baseline, and publish. When publish() returns, every replica serves the
new weights; the next completions say so in their weight versions.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlsync.client import CoordinatorClient
from rlsync.models import resolve_model
from rlsync.publish import WeightMap, WeightPublisher

parser = argparse.ArgumentParser()
parser.add_argument("--coordinator", default=os.environ.get("RLSYNC_COORDINATOR", "127.0.0.1:50050"),
                    help="coordinator address (default: $RLSYNC_COORDINATOR, which `rlsync up` sets)")
parser.add_argument("--model", default="tiny")
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--lr", type=float, default=2e-3)
parser.add_argument("--publish-dtype", default="", help="cast on the way out, e.g. bfloat16 (default: as trained)")
args = parser.parse_args()

torch.manual_seed(0)
path = resolve_model(args.model)
tokenizer = AutoTokenizer.from_pretrained(path)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # the replicas start from the same weights
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
digits = torch.tensor([tokenizer.decode([i]).strip().isdigit() for i in range(len(tokenizer))])
prompts = ["numbers:", "count to ten", "the sum is", "write digits"]
weights = WeightMap(dtype=getattr(torch, args.publish_dtype) if args.publish_dtype else None)

with CoordinatorClient(args.coordinator, timeout=None) as fleet, \
        WeightPublisher(model, args.coordinator, weights=weights) as publisher:
    for step in range(1, args.steps + 1):
        losses, rewards, versions = [], [], set()
        for prompt in prompts:
            group = fleet.complete(prompt, n=8, max_tokens=16, temperature=1.0)
            reward = torch.tensor([digits[c.token_ids].float().mean().item() if c.token_ids else 0.0 for c in group])
            advantage = reward - reward.mean()
            for completion, a in zip(group, advantage):
                ids = torch.tensor([completion.prompt_token_ids + completion.token_ids])
                logprobs = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
                losses.append(-a * logprobs[len(completion.prompt_token_ids) - 1:].sum())
                versions.add(completion.max_weight_version)
            rewards.append(reward.mean().item())
        optimizer.zero_grad()
        torch.stack(losses).mean().backward()
        optimizer.step()
        sync = publisher.publish(step, verify=True)  # every replica serves these weights from here on
        print(json.dumps({"step": step, "reward": round(sum(rewards) / len(rewards), 4),
                          "generated_by_versions": sorted(versions), "serving": sync.version,
                          "sync_ms": round(sync.seconds * 1000, 1), "verified": sync.verified}), flush=True)
