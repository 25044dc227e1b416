"""One rank of examples/fsdp2_publish.py, started by a test (not torchrun, which would end the other
ranks as soon as one dies). RLSYNC_FAULT=die_after_pieces:N makes this rank die (no cleanup) once it
has cut N pieces of its shards for sending: in the middle of a publish, whatever the other ranks do;
hang_after_pieces:N stops it there instead (SIGSTOP, once), until the test sends SIGCONT."""

import os
import runpy
import signal
import sys
from pathlib import Path

fault = os.environ.get("RLSYNC_FAULT", "")
if fault.startswith(("die_after_pieces:", "hang_after_pieces:")):
    from rlsync.publish.layout import RankShards

    limit, real = int(fault.split(":")[1]), RankShards.piece
    count = {"n": 0}

    def _piece_then_maybe_die(*args):
        count["n"] += 1
        if count["n"] > limit and fault.startswith("die"):
            os._exit(9)
        if count["n"] == limit + 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        return real(*args)

    RankShards.piece = _piece_then_maybe_die

example = Path(__file__).resolve().parents[1] / "examples" / "fsdp2_publish.py"
sys.argv = [str(example), *sys.argv[1:]]
runpy.run_path(str(example), run_name="__main__")
