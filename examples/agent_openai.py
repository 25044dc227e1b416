"""An agent-style RL loop written against the OpenAI API: multi-turn, tool-using episodes through the
official `openai` client (what agent frameworks speak), and trained on with rlsync.

Each episode asks for a sum. The system prompt offers a calculator tool (`CALL add <a> <b>`); after
every assistant turn the environment answers as the tool (the sum, when the turn called it
correctly, else how to call it), for up to --turns turns. From every assistant turn the API hands
back what training needs (`return_token_ids`, `logprobs`): the rendered conversation's token ids,
the turn's token ids, their log-probabilities and the weight version of each token (`rlsync`
field of the choice). The episode's reward (how much of the right sum its last turn says) goes to
every turn; episodes of one task form a GRPO group. Then Train and SyncWeights on the coordinator
(gRPC): the next episodes run on the new weights.

    python examples/agent_openai.py --coordinator HOST:PORT --http HOST:PORT [--steps 3] [--token T]

(Start the coordinator with --http-port; `make demo` does not. With the tiny random model the
"agent" babbles, but every mechanism is the real one.)
"""

from __future__ import annotations

import argparse
import json
import random
import re

import openai

from rlsync.client import CoordinatorClient
from rlsync.trainer.v1 import trainer_pb2

SYSTEM = "You can use a calculator: write CALL add <a> <b> and the tool answers. Then give the sum."


def tool(turn: str, a: int, b: int) -> str:
    """The environment's answer to one assistant turn."""
    call = re.search(r"CALL add (-?\d+) (-?\d+)", turn)
    if call is None:
        return "no tool call; write CALL add <a> <b>"
    return str(int(call.group(1)) + int(call.group(2)))


def reward(last_turn: str, a: int, b: int) -> float:
    """The share of the right sum's digits that the last turn states, in order."""
    want = str(a + b)
    got = re.sub(r"\D", "", last_turn)
    return sum(1 for x, y in zip(want, got) if x == y) / len(want)


def versions(ext: dict) -> list[int]:
    """The weight version of each token, from the choice's spans."""
    return [s["weight_version"] for s in ext["weight_version_spans"] for _ in range(s["length"])]


def episode(http: openai.OpenAI, model: str, a: int, b: int, turns: int, seed: int) -> list[dict]:
    """Runs one conversation; returns its assistant turns (token ids, logprobs, versions, text)."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a}+{b}?"}]
    out = []
    for t in range(turns):
        answer = http.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=1.0,
                                              seed=seed * 100 + t, logprobs=True,
                                              extra_body={"return_token_ids": True})
        choice = answer.choices[0]
        ext = choice.model_extra["rlsync"]
        text = choice.message.content or ""
        out.append({"prompt_ids": ext["prompt_token_ids"], "completion_ids": ext["token_ids"],
                    "logprobs": [c.logprob for c in choice.logprobs.content], "versions": versions(ext),
                    "text": text})
        messages += [{"role": "assistant", "content": text}, {"role": "tool", "content": tool(text, a, b)}]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--coordinator", required=True, help="the coordinator's gRPC address")
    parser.add_argument("--http", required=True, help="the coordinator's HTTP address (its --http-port)")
    parser.add_argument("--token", default="", help="the fleet's bearer token, if it has one")
    parser.add_argument("--model", default="rlsync")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=3, help="episodes per task (a GRPO group)")
    parser.add_argument("--turns", type=int, default=2)
    args = parser.parse_args()
    http = openai.OpenAI(base_url=f"http://{args.http}/v1", api_key=args.token or "none")
    rng = random.Random(0)
    with CoordinatorClient(args.coordinator, token=args.token) as coordinator:
        for step in range(args.steps):
            trajectories, rewards, turns = [], [], 0
            for task in range(args.tasks):
                a, b = rng.randint(10, 99), rng.randint(10, 99)
                for e in range(args.episodes):
                    steps = episode(http, args.model, a, b, args.turns, seed=step * 1000 + task * 10 + e)
                    r = reward(steps[-1]["text"], a, b)
                    rewards.append(r)
                    turns += len(steps)
                    trajectories += [trainer_pb2.Trajectory(
                        prompt_ids=s["prompt_ids"], completion_ids=s["completion_ids"], reward=r,
                        behavior_logprobs=s["logprobs"], token_versions=s["versions"], group_id=f"{step}-{task}")
                        for s in steps]
            trained = coordinator.train(trajectories)
            sync = coordinator.sync_weights(verify=True)
            print(json.dumps({"step": step + 1, "episodes": len(rewards), "assistant_turns": turns,
                              "mean_reward": round(sum(rewards) / len(rewards), 3),
                              "trained_on": len(trajectories), "loss": round(trained.metrics.get("loss", 0.0), 4),
                              "synced_version": sync.version, "verified": sync.verified}), flush=True)


if __name__ == "__main__":
    main()
