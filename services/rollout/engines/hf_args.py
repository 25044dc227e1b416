"""The hf engine's arguments (--engine-args / -E), in a module of their own: `rlsync rollout --engine hf`
checks them at start, before it imports the engine (torch and transformers: seconds), and refuses bad ones
in one line."""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from rlsync.errors import InvalidArgument


@dataclasses.dataclass
class HFEngineArgs:
    """Arguments of the hf engine (pass with --engine-args); unknown keys are refused."""

    dtype: str = "auto"  # auto = the checkpoint's dtype; or float32, bfloat16, float16
    device: str = "auto"  # auto = cuda when available, else cpu
    max_num_seqs: int = 64  # completions decoded together; more wait in a queue
    # Prompt tokens prefilled in one step at most (a request's own prompt always goes whole): many
    # requests arriving together join over several steps instead of stalling every running one.
    max_prefill_tokens: int = 2048
    max_model_len: int = 0  # 0 = the model's max_position_embeddings
    seed: int = 0  # seeds completions that do not bring their own seed
    # The interpreter's GIL switch interval, set at start: a thread asking for the GIL the decode loop
    # holds (a prepare's hops, the gRPC loop) waits up to this long for it. Python's default is 5 ms.
    switch_interval_ms: float = 0.5
    # On the trainer's GPU, holding its memory mapped: queue the next update's copy at a wake, for the
    # trainer to start on the GPU (rlsync.transfer.armed). False: each update's copy starts at its prepare.
    arm: bool = True
    # Also while generating: as each update commits, queue the next one's copy into the spare weights, behind a
    # bell in host memory (rlsync.transfer.host_bell); a step that runs far longer than the engine's steps do
    # (a launch waiting for the whole device behind the copy) lets it go. Off until measured on a GPU.
    arm_while_generating: bool = False
    # How long a step or command may run beside a copy armed while generating before it is let go: this, or four
    # times the usual step if longer. What waits that long behind the copy (a first launch) goes on once it is.
    arm_patience_ms: float = 20.0

    @classmethod
    def parse(cls, raw: dict[str, Any]) -> HFEngineArgs:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidArgument(f"unknown hf engine argument(s) {', '.join(unknown)}; "
                                  f"valid: {', '.join(sorted(known))}")
        args = cls(**raw)
        if args.max_num_seqs < 1 or args.max_prefill_tokens < 1:
            raise InvalidArgument(f"max_num_seqs and max_prefill_tokens must be >= 1, got {args.max_num_seqs} and "
                                  f"{args.max_prefill_tokens}")
        for name in ("arm", "arm_while_generating"):
            if not isinstance(getattr(args, name), bool):
                raise InvalidArgument(f"hf engine argument {name} must be true or false, got {getattr(args, name)!r}")
        if args.arm_while_generating and not args.arm:
            raise InvalidArgument("hf engine argument arm_while_generating needs arm: true")
        patience = args.arm_patience_ms
        if isinstance(patience, bool) or not (isinstance(patience, (int, float)) and 0 < patience < math.inf):
            raise InvalidArgument(f"hf engine argument arm_patience_ms must be > 0, got {args.arm_patience_ms!r}")
        if not args.switch_interval_ms > 0:
            raise InvalidArgument(f"hf engine argument switch_interval_ms must be > 0, got {args.switch_interval_ms}")
        if args.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise InvalidArgument(f"hf engine argument dtype={args.dtype!r}: auto, float32, bfloat16 or float16")
        if not (isinstance(args.device, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", args.device)):
            raise InvalidArgument(f"hf engine argument device={args.device!r}: auto, cpu, cuda or cuda:N")
        return args
