"""One rank of examples/fsdp2_publish.py, started by a test (not torchrun, which would end the other
ranks as soon as one dies). RLSYNC_FAULT=die_after_buckets:N makes this rank die (no cleanup) once it
has packed and sent N buckets of its pieces: in the middle of a publish, whatever the other ranks do;
hang_after_buckets:N stops it there instead (SIGSTOP, once), until the test sends SIGCONT. (A bucket, not
a piece: a repeat update packs its buckets from the views it kept, cutting no piece.)"""

import os
import runpy
import signal
import sys
from pathlib import Path

fault = os.environ.get("RLSYNC_FAULT", "")
if fault.startswith(("die_after_buckets:", "hang_after_buckets:", "count_buckets")):
    from rlsync.transfer import routed

    limit, real = int(fault.split(":")[1]) if ":" in fault else 1 << 30, routed._Window.add
    count = {"n": 0}

    def _add_then_maybe_die(*args, **kwargs):
        count["n"] += 1
        if fault == "count_buckets":
            print(f"[bucket] {count['n']}", file=sys.stderr, flush=True)
        if count["n"] > limit and fault.startswith("die"):
            os._exit(9)
        if count["n"] == limit + 1 and fault.startswith("hang"):
            os.kill(os.getpid(), signal.SIGSTOP)
        return real(*args, **kwargs)

    routed._Window.add = _add_then_maybe_die

example = Path(__file__).resolve().parents[1] / "examples" / "fsdp2_publish.py"
sys.argv = [str(example), *sys.argv[1:]]
runpy.run_path(str(example), run_name="__main__")
