"""The RL loop an orchestration script drives, in full: generate through the coordinator's gateway,
score, train, sync. Start the services first (see the README), then:

    python examples/rl_loop.py --coordinator 127.0.0.1:50050
"""

import argparse
import os

from transformers import AutoTokenizer

from rlsync.client import CoordinatorClient, trajectory
from rlsync.models import resolve_model

parser = argparse.ArgumentParser()
parser.add_argument("--coordinator", default=os.environ.get("RLSYNC_COORDINATOR", "127.0.0.1:50050"),
                    help="coordinator address (default: $RLSYNC_COORDINATOR, which `rlsync up` sets)")
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

tokenizer = AutoTokenizer.from_pretrained(resolve_model("tiny"))
digits = {i for i in range(len(tokenizer)) if tokenizer.decode([i]).strip().isdigit()}
prompts = ["numbers:", "count to ten", "the sum is", "write digits"]

with CoordinatorClient(args.coordinator, timeout=None) as fleet:
    for step in range(args.steps):
        batch, rewards = [], []
        for g, prompt in enumerate(prompts):
            # One group per prompt: 8 samples; each token says which weight version produced it.
            for completion in fleet.complete(prompt, n=8, max_tokens=16, temperature=1.0, logprobs=True):
                reward = sum(t in digits for t in completion.token_ids) / 16
                rewards.append(reward)
                batch.append(trajectory(completion, reward, group_id=f"{step}-{g}"))
        # GRPO step on the trainer (colocated mode: engines sleep, trainer onloads first) ...
        result = fleet.train(batch)
        # ... then the new weights go to every replica with the configured sync sequence.
        sync = fleet.sync_weights(verify=True)
        print(f"step {result.step}: reward {sum(rewards) / len(rewards):.3f}, serving version {sync.version} "
              f"({sync.seconds * 1000:.0f} ms, verified={sync.verified})")
