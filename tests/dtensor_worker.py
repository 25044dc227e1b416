"""One rank of a 2-rank check (started by a test with RANK/WORLD_SIZE set): a module whose parameters
are DTensors of every placement a trainer may use is published as a sharded source, and rank 0 checks
each tensor its audit gathers against the whole tensor it was sharded from. Prints one JSON line on
rank 0."""

import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from rlsync.publish import WeightMap
from rlsync.publish.source import ShardedModule, module_source

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
torch.manual_seed(0)
whole = {"rows_uneven": torch.randn(5, 3), "cols": torch.randn(4, 6), "replicated": torch.randn(3),
         "empty": torch.randn(0, 4), "fewer_rows_than_ranks": torch.randn(1, 2), "plain": torch.randn(2, 2)}
placements = {"rows_uneven": Shard(0), "cols": Shard(1), "replicated": Replicate(), "empty": Shard(0),
              "fewer_rows_than_ranks": Shard(0)}
model = nn.Module()
for name, t in whole.items():
    value = distribute_tensor(t, mesh, [placements[name]]) if name in placements else t
    model.register_parameter(name, nn.Parameter(value))
source, _ = module_source(model, WeightMap(dtype=torch.bfloat16))
assert isinstance(source, ShardedModule)
produced = dict(source.audit.items())  # one pass: every rank runs the same gathers
if dist.get_rank() == 0:
    wrong = [n for n, t in whole.items() if not torch.equal(produced[n], t.to(torch.bfloat16))]
    print(json.dumps({"checked": sorted(produced), "wrong": wrong}), flush=True)
dist.barrier()  # leave together: a rank tearing gloo down while its peer still talks can abort
dist.destroy_process_group()
# Skip interpreter finalization: gloo's worker threads can still hold work objects whose teardown
# then aborts the process ("terminate called without an active exception") after a correct run.
os._exit(0)
