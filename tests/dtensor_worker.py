"""One rank of a 2-rank check (started by a test with RANK/WORLD_SIZE set): a module whose parameters
are DTensors of every placement a trainer may use is published as a sharded source; each rank checks
the boxes it holds against the whole tensors they were sharded from, and the checksums the ranks'
shares add up to against the whole tensors', and what Ranks.gather brings every rank. Each rank prints
one JSON line."""

import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from rlsync.publish import WeightMap
from rlsync.publish.ranks import BROADCAST_FIRST, Ranks
from rlsync.publish.source import ShardedModule, module_source
from rlsync.transfer.checksum import checksum_tensor, from_sums
from rlsync.transfer.routes import Piece

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
shards, rank = source.shards, dist.get_rank()
wrong = []  # every box this rank holds, cut from its local shard, is the whole tensor's box, cast
for index, entry in enumerate(shards.entries):
    expected = whole[entry.name].to(torch.bfloat16)
    for box in shards.layout.held[rank][index]:
        if not torch.equal(shards.piece(Piece(index, box)), expected[tuple(slice(a, b) for a, b in box)]):
            wrong.append(f"{entry.name} rank {rank}")
# An audit adds up every rank's share of each checksum: it equals the whole tensor's, nothing gathered.
totals = Ranks().add_up([v for pair in shards.checksum_share() for v in pair])
audit = {s.name: from_sums(s.nbytes, totals[2 * i], totals[2 * i + 1]) for i, s in enumerate(source.specs)}
wrong += [n for n, t in whole.items() if audit[n] != checksum_tensor(t.to(torch.bfloat16))]
# Audited again after a step in place, then after a parameter moved (its storage replaced): what the first audit
# kept of where the pieces lie serves the first, and is found anew for the second.
with torch.no_grad():
    whole = {n: t.clone() + 1 for n, t in whole.items()}  # (a plain or replicated parameter shares its storage)
    for name in whole:
        model.get_parameter(name).add_(1)
    moved = model.get_parameter("plain")  # (a DTensor's .data set leaves its local tensor as it was)
    moved.data = moved.data * 2
    whole["plain"] = whole["plain"] * 2
totals = Ranks().add_up([v for pair in shards.checksum_share() for v in pair])
again = {s.name: from_sums(s.nbytes, totals[2 * i], totals[2 * i + 1]) for i, s in enumerate(source.specs)}
wrong += [f"{n} after a step" for n, t in whole.items() if again[n] != checksum_tensor(t.to(torch.bfloat16))]
# What rank 0 gathers at an onload (each rank's storages): every rank's bytes, whatever their lengths.
class Counted(Ranks):
    rounds = 0

    def _all_gather(self, mine):
        self.rounds += 1
        return super()._all_gather(mine)

    def _broadcast(self, t):
        self.rounds += 1
        return super()._broadcast(t)


at_most = bytes(range(8)) * 127  # 1016 bytes: what fits the first all-gather beside its length
for pair, rounds in [((b"", b"!"), 1), ((b"abc", b"cba!"), 1), ((at_most, at_most[::-1]), 1),
                     ((at_most, at_most + b"!"), 2), ((bytes(range(256)) * 20, b"x"), 2)]:
    ranks = Counted()
    got = ranks.gather(pair[rank])
    if got != list(pair) or ranks.rounds != rounds:
        wrong.append(f"gather of {[len(p) for p in pair]} bytes on rank {rank}: {ranks.rounds} all-gathers")
# What rank 0 tells the others at each request (rlsync.publish.ranks.PublishPoints): its op, count and payload,
# in one broadcast when the payload fits beside them, whatever the others pass.
fits = bytes(range(256)) * (BROADCAST_FIRST // 256)
fits = fits[:BROADCAST_FIRST - 24]
for payload, rounds in [(b"", 1), (b"describe", 1), (fits, 1), (fits + b"!", 2), (fits * 3, 2)]:
    ranks = Counted()
    got = ranks.broadcast(7, -3, payload if rank == 0 else b"ignored")
    if got != (7, -3, payload) or ranks.rounds != rounds:
        wrong.append(f"broadcast of {len(payload)} bytes on rank {rank}: {ranks.rounds} broadcasts")
print(json.dumps({"checked": [*sorted(audit), "gather", "broadcast"], "wrong": wrong}), flush=True)
dist.barrier()  # leave together: a rank tearing gloo down while its peer still talks can abort
dist.destroy_process_group()
# Skip interpreter finalization: gloo's worker threads can still hold work objects whose teardown
# then aborts the process ("terminate called without an active exception") after a correct run.
os._exit(0)
