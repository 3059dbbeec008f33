"""``.ci/gpu``, the prepared GPU check, parses (a GPU machine is lent rarely: a syntax error found
there costs the loan). ``DEVICE=cpu STEPS=3 bash .ci/gpu`` runs its steps on CPU (2 minutes; by hand)."""

import pathlib
import subprocess


def test_the_gpu_script_parses():
    script = pathlib.Path(__file__).parents[2] / ".ci" / "gpu"
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
