"""Generated stubs are committed; they must match the protos (regenerate with `make protos`)."""

import subprocess
import sys


def test_generated_stubs_are_fresh():
    out = subprocess.run([sys.executable, "-m", "rlsync.protogen", "--check"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
