"""Diagnostic: what a GPU trainer still holds after Offload, with and without a CUDA IPC publish.
Prints live CUDA tensors by size. (Run on the GPU machine.)"""

import asyncio
import gc
import subprocess
import sys

import torch

from rlsync.config import build
from rlsync.trainer.config import TrainerConfig
from rlsync.trainer.core import Trajectory, TrainerCore
from rlsync.transfer.peer import decode, encode
from rlsync.transfer.v1 import transfer_pb2 as pb


def live(tag):
    gc.collect()
    tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda]
    big = sorted(((t.untyped_storage().nbytes(), tuple(t.shape), str(t.dtype)) for t in tensors), reverse=True)[:5]
    print(tag, "allocated", torch.cuda.memory_allocated() >> 20, "MiB reserved", torch.cuda.memory_reserved() >> 20,
          "MiB, live cuda tensors:", len(tensors), big, flush=True)
    if tag.startswith("after offload") and tensors:
        t = max(tensors, key=lambda x: x.untyped_storage().nbytes())
        for ref in gc.get_referrers(t)[:6]:
            keys = [k for k, v in ref.items() if v is t][:3] if isinstance(ref, dict) else ""
            print("   held by", type(ref).__name__, keys, str(ref)[:160] if not isinstance(ref, dict) else "",
                  flush=True)


async def main(publish: bool):
    core = TrainerCore(build(TrainerConfig, device="cuda", model=sys.argv[1] if len(sys.argv) > 1 else "tiny"))
    traj = [Trajectory([1, 2, 3], [4, 5, 6], float(i), group_id="g") for i in range(4)]
    await core.train(traj)
    live("after train")
    if publish:
        offer = await core.publisher.offer(core.step)
        peer = subprocess.Popen([sys.executable, "-m", "rlsync.transfer.peer", "receive", "--device", "cuda", "--loop"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        peer.stdin.write(encode(offer) + "\n")
        peer.stdin.flush()
        ans = next(decode(pb.Answer, line.split(" ", 1)[1]) for line in peer.stdout if line.startswith("ANSWER"))
        await core.publisher.publish(offer.transfer_id, [ans])
        print(next(line for line in peer.stdout if line.startswith("RESULT")).strip())
        live("after publish")
    await core.publisher.offload()
    live("after offload")
    await core.publisher.onload()
    await core.train(traj)
    await core.publisher.offload()
    live("after 2nd offload")


for publish in (True,):
    print("publish:", publish)
    asyncio.run(main(publish))
