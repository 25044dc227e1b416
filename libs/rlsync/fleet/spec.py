"""The fleet file: one YAML (or JSON) document that says what runs where. Decoded with msgspec into
typed structs, so a wrong key, type or value is refused with the path to it before anything starts.

    name: demo                      # the fleet's name on the Ray cluster (default: rlsync)
    model: tiny                     # every member's model (folder, or the embedded tiny one)
    sync: async                     # async or inflight (separate devices; inflight: no pause), colocated (shared GPU)
    coordinator: {port: 50050}
    trainer: {nproc: 1, gpus_per_rank: 0, args: ["--lr", "1e-3"]}     # or script: my_loop.py
    rollout:
      - {name: rollout, engine: vllm, replicas: 4, gpus: 1, engine_args: {max_num_seqs: 64}}
      - {name: sgl, engine: sglang, replicas: 2, gpus: 1}    # env: {RLSYNC_SGLANG_PYTHON: ...} where it lives
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

import msgspec

from rlsync.errors import InvalidArgument

_NAME = re.compile(r"^[a-z][a-z0-9-]{0,30}$")
_RESERVED = {"coordinator", "trainer", "fleet", "cluster"}  # member and event names of their own
_SET_BY_THE_FLEET = {"RLSYNC_HOST", "RLSYNC_ADVERTISE", "RLSYNC_NODE_ID", "RLSYNC_COORDINATOR", "RLSYNC_TOKEN"}


class _Spec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    pass


class CoordinatorSpec(_Spec):
    port: int = 50050  # 0 picks a free one (tests)
    cpus: float = 0.0  # a control plane that waits on sockets: it takes no CPU from the others
    args: list[str] = []  # more `rlsync coordinator` flags (--max-staleness 2, ...)


class TrainerSpec(_Spec):
    script: str = ""  # a training loop of your own that embeds rlsync.publish.WeightPublisher
    args: list[str] = []  # flags of `rlsync trainer`, or the script's arguments
    nproc: int = 1  # ranks (the service's --nproc; a script runs under torchrun when > 1)
    gpus_per_rank: float = 0.0
    cpus: float = 1.0
    resources: dict[str, float] = {}  # Ray custom resources its node must have (node types: {trainer_node: 1})


class RolloutGroup(_Spec):
    name: str = "rollout"
    engine: Literal["vllm", "sglang", "hf"] = "vllm"  # sglang: its Python is $RLSYNC_SGLANG_PYTHON on every node
    replicas: int = 1
    gpus: float = 0.0  # per replica (tensor-parallel engines take several)
    cpus: float = 1.0
    resources: dict[str, float] = {}  # per replica: Ray custom resources its node must have
    engine_args: dict[str, Any] = {}
    args: list[str] = []  # more `rlsync rollout` flags
    restart: bool = True  # a replica that exits or loses its node is started again (when resources allow)


class FleetSpec(_Spec):
    name: str = "rlsync"
    model: str = "tiny"
    sync: Literal["async", "inflight", "colocated"] = "async"
    token: str = ""  # shared secret for every RPC (default: the launcher's $RLSYNC_TOKEN)
    env: dict[str, str] = {}  # environment for every member (VLLM_CPU_KVCACHE_SPACE, ...)
    log_dir: str = "/tmp/rlsync-fleet"  # on every node: <log_dir>/<fleet>/<member>.log
    coordinator: CoordinatorSpec = msgspec.field(default_factory=CoordinatorSpec)
    trainer: TrainerSpec = msgspec.field(default_factory=TrainerSpec)
    rollout: list[RolloutGroup] = msgspec.field(default_factory=lambda: [RolloutGroup()])

    def group(self, name: str) -> RolloutGroup:
        for g in self.rollout:
            if g.name == name:
                return g
        raise InvalidArgument(f"the fleet has no rollout group {name!r} (it has: "
                              f"{', '.join(g.name for g in self.rollout)})")


def _check(spec: FleetSpec) -> FleetSpec:
    """Rules a type cannot say; each message names the field."""
    problems = []
    if not _NAME.match(spec.name):
        problems.append(f"name: {spec.name!r} must be lowercase letters, digits and '-', starting with a letter")
    if not 0 <= spec.coordinator.port <= 65535:
        problems.append(f"coordinator.port: {spec.coordinator.port} is not a port")
    t = spec.trainer
    if t.nproc < 1:
        problems.append(f"trainer.nproc: {t.nproc} must be >= 1")
    if t.gpus_per_rank < 0 or t.cpus < 0 or spec.coordinator.cpus < 0:
        problems.append("cpus and gpus must be >= 0")
    if t.gpus_per_rank > 1 and t.gpus_per_rank != int(t.gpus_per_rank):
        problems.append(f"trainer.gpus_per_rank: {t.gpus_per_rank} must be a whole number when above 1")
    if t.nproc > 1 and 0 < t.gpus_per_rank < 1:
        problems.append(f"trainer.gpus_per_rank: {t.gpus_per_rank} with nproc {t.nproc}: each rank takes a GPU "
                        "of its own (1), or none (0)")
    for key in sorted(_SET_BY_THE_FLEET & set(spec.env)):
        problems.append(f"env.{key}: set by the fleet for each member (the token goes in `token:`)")
    names = [g.name for g in spec.rollout]
    if not spec.rollout:
        problems.append("rollout: at least one group is needed")
    for i, g in enumerate(spec.rollout):
        where = f"rollout[{i}] ({g.name})"
        if not _NAME.match(g.name):
            problems.append(f"{where}.name: must be lowercase letters, digits and '-', starting with a letter")
        if g.name in _RESERVED:
            problems.append(f"{where}.name: {g.name!r} is reserved; call the group something else")
        if names.count(g.name) > 1:
            problems.append(f"{where}.name: {g.name!r} is used twice")
        if g.replicas < 0:
            problems.append(f"{where}.replicas: {g.replicas} must be >= 0")
        if g.gpus < 0 or g.cpus < 0:
            problems.append(f"{where}: cpus and gpus must be >= 0")
        if g.gpus > 1 and g.gpus != int(g.gpus):
            problems.append(f"{where}.gpus: {g.gpus} must be a whole number when above 1")
    if spec.sync == "colocated":
        if len(spec.rollout) != 1 or t.nproc != 1 or t.script:
            problems.append("sync: colocated places the trainer (rlsync's, nproc 1) and one rollout group's "
                            "replicas on one device; shard over several GPUs with sync: async")
        elif max(spec.rollout[0].gpus, t.gpus_per_rank) > 1:
            problems.append("sync: colocated shares one GPU between the trainer and its replicas: gpus <= 1")
    if problems:
        raise InvalidArgument("invalid fleet file:\n  " + "\n  ".join(problems))
    return spec


def parse(text: str | bytes, source: str = "fleet file") -> FleetSpec:
    """A FleetSpec from YAML (JSON is YAML too); refuses unknown keys, wrong types and bad values."""
    try:
        spec = msgspec.yaml.decode(text, type=FleetSpec)
    except msgspec.ValidationError as e:
        raise InvalidArgument(f"invalid {source}: {e}") from None
    except msgspec.DecodeError as e:
        raise InvalidArgument(f"{source} is not valid YAML: {e}") from None
    return _check(spec)


def load(path: str | Path) -> FleetSpec:
    """Reads and checks a fleet file; a trainer script's path becomes absolute (relative to the file)."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as e:
        raise InvalidArgument(f"cannot read the fleet file {path}: {e.strerror}") from None
    spec = parse(text, str(path))
    if spec.trainer.script and not os.path.isabs(spec.trainer.script):
        script = (path.parent / spec.trainer.script).resolve()
        if not script.exists():
            script = Path(spec.trainer.script).resolve()
        spec.trainer.script = str(script)
    if spec.trainer.script and not Path(spec.trainer.script).is_file():
        raise InvalidArgument(f"trainer.script: {spec.trainer.script} does not exist (the path must be the same "
                              "on the node that runs the trainer)")
    return spec


def encode(spec: FleetSpec) -> str:
    """The spec as JSON text: what crosses to the fleet's Ray actor (plain values, no pickle)."""
    return msgspec.json.encode(spec).decode()


def decode(text: str) -> FleetSpec:
    return msgspec.json.decode(text, type=FleetSpec)
