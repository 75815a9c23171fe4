"""The Python example runs as documented (CPU; CUDA when available)."""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
from reference_torch import cuda_skip_reason  # noqa: E402 (needs torch)

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "verify_step.py")


def _run(*args):
    r = subprocess.run([sys.executable, EXAMPLE, *args], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.slow
def test_verify_step_example_cpu():
    out = _run()
    assert "spec rows: 3" in out
    assert out.count("finite=True") == 2


@pytest.mark.gpu
@pytest.mark.skipif(cuda_skip_reason() is not None, reason=f"CUDA: {cuda_skip_reason()}")
def test_verify_step_example_cuda():
    out = _run("--device", "cuda")
    assert out.count("finite=True") == 2
