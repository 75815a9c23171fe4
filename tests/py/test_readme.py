"""The README's first Python example (the newcomer's first call) runs as written and is correct:
extracted from README.md, executed in a fresh namespace, its outputs and state checked against the
float64 reference it computes, and its shapes as its comments state."""

from __future__ import annotations

import contextlib
import io
import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def _first_python_block() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    assert blocks, "README.md has no ```python block"
    return blocks[0]


def test_readme_first_example_runs_and_is_correct():
    code = _first_python_block()
    assert "gdn.decode_mtp(" in code and "help(gdn.decode_mtp)" in README.read_text()
    scope: dict = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(README), "exec"), scope)
    out, state, ref_out, ref_state = (scope[k] for k in ("out", "state", "ref_out", "ref_state"))
    H, HV, K, V, L = (scope[k] for k in ("H", "HV", "K", "V", "L"))
    assert scope["mixed_qkv"].shape == (L, 2 * H * K + HV * V) and out.shape == (L, HV, V)
    assert L == int(scope["cu_seqlens"][-1])
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-5)
    np.testing.assert_allclose(state, ref_state, rtol=0, atol=1e-5)
    errors = [float(x) for x in printed.getvalue().split()]
    assert len(errors) == 2 and max(errors) < 1e-5, printed.getvalue()
