"""The trainer service: a policy on torch, GRPO-style steps, offload/onload, checkpoints, weight publishing."""
