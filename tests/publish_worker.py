"""One rank of examples/fsdp2_publish.py, started by a test (not torchrun, which would end the other
ranks as soon as one dies). RLSYNC_FAULT=die_after_gathers:N makes this rank die (no cleanup) once it
has produced N tensors for publishing: in the middle of a publish, whatever the other ranks do."""

import os
import runpy
import sys
from pathlib import Path

fault = os.environ.get("RLSYNC_FAULT", "")
if fault.startswith("die_after_gathers:"):
    from rlsync.publish import source

    limit, real = int(fault.split(":")[1]), source._whole
    count = {"n": 0}

    def _whole_then_maybe_die(*args):
        count["n"] += 1
        if count["n"] > limit:
            os._exit(9)
        return real(*args)

    source._whole = _whole_then_maybe_die

example = Path(__file__).resolve().parents[1] / "examples" / "fsdp2_publish.py"
sys.argv = [str(example), *sys.argv[1:]]
runpy.run_path(str(example), run_name="__main__")
