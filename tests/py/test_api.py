"""The Python package around decode_mtp: import without torch, the supported set and the guard
(read from the one C++ list), the type stubs and `python -m gdn`."""

from __future__ import annotations

import inspect
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import gdn

torch = pytest.importorskip("torch")

from reference_torch import make_case  # noqa: E402 (needs torch)


def _python(*code: str, args=(), timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs the code pieces (each dedented on its own) in a fresh interpreter."""
    source = "\n".join(textwrap.dedent(c) for c in code)
    return subprocess.run([sys.executable, "-c", source, *args], env=dict(os.environ),
                          capture_output=True, text=True, timeout=timeout)


_NO_TORCH = """
    import importlib.abc, sys

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"{name} is hidden for this test")
            return None

    sys.meta_path.insert(0, NoTorch())
    for name in [m for m in sys.modules if m == "torch" or m.startswith("torch.")]:
        del sys.modules[name]
"""


def test_import_and_run_without_torch(gen, tmp_path):
    """With torch unimportable, `import gdn` works, registers no torch ops, and decode_mtp runs on
    NumPy arrays, giving the same bits as a torch-tensor call in this process."""
    case = make_case(gen, H=1, HV=2, K=16, V=16, S=3, T=(3, 0, 2),
                     dtypes=dict(mixed_qkv=torch.float16, z=torch.float16))
    arrays = {name: getattr(case, name).numpy() for name in
              ("mixed_qkv", "a", "b", "A_log", "dt_bias", "state", "state_indices", "cu_seqlens",
               "z", "norm_weight", "num_accepted_tokens")}
    np.savez(tmp_path / "inputs.npz", **arrays)
    result = _python(_NO_TORCH, """
        import numpy as np
        try:
            import torch  # noqa: F401
        except ImportError:
            pass
        else:
            raise SystemExit("the torch blocker did not work")
        import gdn
        assert "torch" not in sys.modules, "gdn imported torch"
        assert "gdn.ops" not in sys.modules, "gdn registered torch ops without torch"
        assert gdn.supported_head_ratios() == [1, 2, 3, 4, 8]
        x = dict(np.load(sys.argv[1] + "/inputs.npz"))
        out = np.full((x["mixed_qkv"].shape[0], 2, 16), np.nan, np.float32)
        gdn.decode_mtp(x["mixed_qkv"], x["a"], x["b"], x["A_log"], x["dt_bias"], x["state"],
                       x["state_indices"], x["cu_seqlens"], out, z=x["z"],
                       norm_weight=x["norm_weight"], num_accepted_tokens=x["num_accepted_tokens"])
        np.savez(sys.argv[1] + "/result.npz", out=out, state=x["state"])
        print("ran without torch")
    """, args=[str(tmp_path)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ran without torch" in result.stdout
    got = np.load(tmp_path / "result.npz")
    case.poison_out()
    case.run()
    np.testing.assert_array_equal(got["out"], case.out.numpy())
    np.testing.assert_array_equal(got["state"], case.state.numpy())


def test_torch_ops_registered_with_torch():
    assert hasattr(torch.ops.gdn, "decode_mtp")
    assert "gdn.ops" in sys.modules


def test_supported_set_comes_from_the_library():
    assert gdn.supported_head_ratios() == [1, 2, 3, 4, 8]
    assert gdn.supported_state_dtypes() == ["float32", "bfloat16", "float16"]
    assert gdn._C.cuda_head_dims() == [128]
    assert gdn._C.cuda_max_spec_columns == 16


@pytest.mark.parametrize("H,HV", [(16, 16), (16, 32), (2, 6), (16, 64), (1, 8)])
def test_guard_cpu_listed_ratios_are_fast(H, HV):
    path, reason = gdn.can_use_decode_mtp("cpu", H, HV, 128, 128, 4, "float32")
    assert path == "fast" and str(HV // H) in reason


@pytest.mark.parametrize("H,HV", [(1, 5), (2, 12), (1, 16)])
def test_guard_cpu_other_integral_ratios_are_generic(H, HV):
    path, reason = gdn.can_use_decode_mtp("cpu", H, HV, 64, 64, 2, "bfloat16")
    assert path == "generic" and "run-time ratio" in reason


# Non-integral ratios whose floor quotient is a listed ratio: 6 // 4 = 1, 8 // 3 = 2, 24 // 16 = 1,
# 50 // 16 = 3, 9 // 2 = 4. Each must be refused, on every device.
NON_INTEGRAL = [(4, 6), (3, 8), (16, 24), (16, 50), (2, 9)]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("H,HV", NON_INTEGRAL)
def test_guard_refuses_non_integral_ratio(H, HV, device):
    path, reason = gdn.can_use_decode_mtp(device, H, HV, 128, 128, 1, "float32")
    assert path == "unsupported"
    assert "not a multiple" in reason and f"HV = {HV}" in reason


@pytest.mark.parametrize("H,HV", NON_INTEGRAL[:3])
def test_decode_mtp_refuses_non_integral_ratio(gen, H, HV):
    """The function agrees with the guard: the same configurations fail validation."""
    K = V = 8
    case = make_case(gen, H=H, HV=HV, K=K, V=V, S=1, T=(1,), acc=(1,))
    message = f"value heads HV = {HV} are not a multiple of key heads H = {H}"
    with pytest.raises(ValueError, match=message):
        case.run()


def test_guard_rejects_bad_sizes_and_names():
    assert gdn.can_use_decode_mtp("cpu", 0, 16)[0] == "unsupported"
    assert gdn.can_use_decode_mtp("cpu", 16, 16, 128, 128, 0)[0] == "unsupported"
    with pytest.raises(ValueError, match="state_dtype"):
        gdn.can_use_decode_mtp("cpu", 16, 32, state_dtype="float64")
    with pytest.raises(ValueError, match="device"):
        gdn.can_use_decode_mtp("tpu", 16, 32)


def test_guard_cuda():
    usable = (gdn._C.built_with_cuda and gdn.cuda_device_count() > 0
              and gdn.cuda_kernels_available(0)[0])
    fast = gdn.can_use_decode_mtp("cuda", 16, 48, 128, 128, 4, "bfloat16")
    odd_dim = gdn.can_use_decode_mtp("cuda", 16, 32, 64, 64, 4, "float32")
    deep = gdn.can_use_decode_mtp("cuda", 16, 32, 128, 128, 17, "float32")
    if not usable:
        for path, reason in (fast, odd_dim, deep):
            assert path == "unsupported" and "CUDA" in reason
        return
    assert fast[0] == "fast"
    assert odd_dim[0] == "unsupported" and "K = V = 128" in odd_dim[1]
    assert deep[0] == "unsupported" and "S <= 16" in deep[1]


def test_python_signature():
    params = inspect.signature(gdn.decode_mtp).parameters
    names = list(params)
    assert names[:9] == ["mixed_qkv", "a", "b", "A_log", "dt_bias", "state", "state_indices",
                         "cu_seqlens", "out"]
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in names[9:])
    assert {"z", "norm_weight", "num_accepted_tokens", "scale", "gate", "state_layout",
            "first_valid_slot", "num_k_heads"} <= set(names[9:])
    assert "decode_mtp" in gdn.__all__ and "can_use_decode_mtp" in gdn.__all__


def test_stream_of_host_arrays_is_none():
    from gdn._api import _stream_of
    assert _stream_of(torch.zeros(1), None) is None
    assert _stream_of(np.zeros(1), None) is None
    assert _stream_of(torch.zeros(1), 1234) == 1234


def test_type_stubs_present():
    """The nanobind stub of gdn._C ships next to the module (installed package) or the built module
    (developer build) and describes decode_mtp."""
    module = pathlib.Path(gdn._C.__file__)
    candidates = [pathlib.Path(gdn.__file__).parent / "_C.pyi", module.resolve().parent / "_C.pyi"]
    stub = next((p for p in candidates if p.is_file()), None)
    assert stub is not None, f"no _C.pyi in {candidates}"
    text = stub.read_text()
    assert "def decode_mtp(" in text and "def can_use_decode_mtp(" in text
    assert "num_accepted_tokens" in text


def test_python_m_gdn_self_check():
    result = subprocess.run([sys.executable, "-m", "gdn"], capture_output=True, text=True,
                            env=dict(os.environ), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "self-check: PASS" in result.stdout
    assert f"gdn {gdn.__version__}" in result.stdout and "FAIL" not in result.stdout


def test_guard_names_the_kv_layout_as_the_slow_cuda_path():
    """The "kv" pool layout runs the CUDA kernel's slow path; the guard says so (when the build
    has CUDA kernels for the device), and the CPU path is the same for both layouts."""
    assert gdn.can_use_decode_mtp("cpu", 16, 32, state_layout="kv")[0] == "fast"
    path, reason = gdn.can_use_decode_mtp("cuda", 16, 32, 128, 128, 4, state_layout="kv")
    vk_path, _ = gdn.can_use_decode_mtp("cuda", 16, 32, 128, 128, 4, state_layout="vk")
    if vk_path == "unsupported":  # no device or no kernel image: both layouts refused alike
        assert path == "unsupported"
    else:
        assert vk_path == "fast"
        assert path == "generic" and "slow path" in reason
