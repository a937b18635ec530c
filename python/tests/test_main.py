"""`python -m ferry ARGS` runs the ferry program: the package's own (installed), else FERRY_BINARY or the build's."""
import os
import subprocess
import sys

import pytest

import ferry

bundled = os.path.isfile(os.path.join(os.path.dirname(ferry.__file__), "bin", "ferry"))


def run_module(*args, **env):
    environ = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **env}
    return subprocess.run([sys.executable, "-m", "ferry", *args], env=environ, capture_output=True, text=True,
                          timeout=120)


def test_module_runs_the_program():
    out = run_module("info")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.startswith(f"ferry {ferry.__version__}")


@pytest.mark.skipif(bundled, reason="the installed package runs its own program")
def test_a_wrong_program_is_named():
    out = run_module("info", FERRY_BINARY="/nonexistent/ferry")
    assert out.returncode == 2
    assert "FERRY_BINARY=/nonexistent/ferry is not an executable file" in out.stderr
