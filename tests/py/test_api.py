"""The Python package around decode_mtp: import without torch, the supported set and the guard
(read from the one C++ list), the type stubs and `python -m gdn`."""

from __future__ import annotations

import importlib
import inspect
import os
import pathlib
import pydoc
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import gdn
from gdn import metadata as M

torch = pytest.importorskip("torch")

from reference_torch import cuda_skip_reason, make_case  # noqa: E402 (needs torch)


def _python(*code: str, args=(), timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs the code pieces (each dedented on its own) in a fresh interpreter."""
    source = "\n".join(textwrap.dedent(c) for c in code)
    return subprocess.run(
        [sys.executable, "-c", source, *args], env=dict(os.environ), capture_output=True, text=True, timeout=timeout
    )


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
    case = make_case(
        gen, H=1, HV=2, K=16, V=16, S=3, T=(3, 0, 2), dtypes=dict(mixed_qkv=torch.float16, z=torch.float16)
    )
    arrays = {
        name: getattr(case, name).numpy()
        for name in (
            "mixed_qkv",
            "a",
            "b",
            "A_log",
            "dt_bias",
            "state",
            "state_indices",
            "cu_seqlens",
            "z",
            "norm_weight",
            "num_accepted_tokens",
        )
    }
    np.savez(tmp_path / "inputs.npz", **arrays)
    result = _python(
        _NO_TORCH,
        """
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
    """,
        args=[str(tmp_path)],
    )
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
    usable = gdn._C.built_with_cuda and gdn.cuda_device_count() > 0 and gdn.cuda_kernels_available(0)[0]
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
    assert names[:9] == ["mixed_qkv", "a", "b", "A_log", "dt_bias", "state", "state_indices", "cu_seqlens", "out"]
    assert all(params[n].kind is inspect.Parameter.KEYWORD_ONLY for n in names[9:])
    assert {
        "z",
        "norm_weight",
        "num_accepted_tokens",
        "scale",
        "gate",
        "state_layout",
        "first_valid_slot",
        "num_k_heads",
    } <= set(names[9:])
    assert "decode_mtp" in gdn.__all__ and "can_use_decode_mtp" in gdn.__all__


def test_stream_of_host_arrays_is_none():
    from gdn._common import _stream_of

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


@pytest.mark.slow
def test_python_m_gdn_self_check():
    result = subprocess.run(
        [sys.executable, "-m", "gdn"], capture_output=True, text=True, env=dict(os.environ), timeout=300
    )
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


# ---- one module per operation ------------------------------------------------------------------


def test_package_layout_per_operation():
    """gdn/decode_mtp.py, gdn/conv.py, gdn/metadata.py each hold the function, its contract and
    its reference; gdn.decode_mtp is the function (the module is reached through importlib);
    gdn.reference re-exports the references; gdn.ops registers every op."""
    module = importlib.import_module("gdn.decode_mtp")
    assert module.decode_mtp is gdn.decode_mtp
    assert module.can_use_decode_mtp is gdn.can_use_decode_mtp
    assert callable(gdn.decode_mtp) and gdn.decode_mtp.__module__ == "gdn.decode_mtp"
    from gdn.conv import causal_conv1d_update, causal_conv1d_update_reference

    assert causal_conv1d_update is gdn.causal_conv1d_update
    from gdn.reference import causal_conv1d_update_reference as conv_ref, decode_mtp_reference, step_reference

    assert decode_mtp_reference is module.decode_mtp_reference
    assert conv_ref is causal_conv1d_update_reference and step_reference is M.step_reference
    from gdn import ops

    assert set(ops.FUNCTIONS) == {
        "decode_mtp",
        "decode_mtp_replay",
        "causal_conv1d_update",
        "causal_conv1d_prefill",
        "prefill",
        "metadata_plan",
        "metadata_state_rows",
    }


def _public_docstrings():
    """(where, docstring) of every gdn module and of the functions, classes and methods they
    define."""
    import pkgutil

    names = [m.name for m in pkgutil.iter_modules(gdn.__path__) if not m.name.startswith(("lib", "__"))]
    modules = [gdn] + [importlib.import_module(f"gdn.{n}") for n in names if n != "_C"]
    for module in modules:
        yield module.__name__, inspect.getdoc(module) or ""
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            yield f"{module.__name__}.{name}", inspect.getdoc(obj) or ""
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    member = getattr(member, "__func__", member)
                    if callable(member) and (not attr.startswith("_") or attr == "__init__"):
                        yield f"{module.__name__}.{name}.{attr}", inspect.getdoc(member) or ""


def _reach(dotted: str):
    """`dotted` as a user writes it: import its longest module prefix (as `import gdn.x.y`
    would), then attribute access from `gdn`."""
    parts = dotted.split(".")
    for end in range(len(parts), 1, -1):
        try:
            importlib.import_module(".".join(parts[:end]))
            break
        except ImportError:
            continue
    obj = gdn
    for part in parts[1:]:
        obj = getattr(obj, part)
    return obj


def test_names_in_docstrings_are_reachable_as_written():
    """Every dotted ``gdn.x.y`` a docstring names works when typed (e.g. the float64 reference is
    gdn.reference.decode_mtp_reference: gdn.decode_mtp is the function, not its module)."""
    pattern = re.compile(r"(?<![\w./:])gdn(?:\.\w+)+")
    names = {}
    for where, doc in _public_docstrings():
        for dotted in pattern.findall(doc):
            names.setdefault(dotted.rstrip("."), where)
    assert "gdn.reference.decode_mtp_reference" in names
    unreachable = []
    for dotted, where in sorted(names.items()):
        try:
            _reach(dotted)
        except AttributeError as e:
            unreachable.append(f"{dotted} (named in {where}): {e}")
    assert not unreachable, unreachable
    assert gdn.reference.decode_mtp_reference is importlib.import_module("gdn.decode_mtp").decode_mtp_reference
    with pytest.raises(AttributeError):  # what the check above catches
        _reach("gdn.decode_mtp.decode_mtp_reference")


# ---- self-contained contracts ------------------------------------------------------------------

DOCUMENTED = {
    "decode_mtp": gdn.decode_mtp,
    "can_use_decode_mtp": gdn.can_use_decode_mtp,
    "causal_conv1d_update": gdn.causal_conv1d_update,
    "causal_conv1d_prefill": gdn.causal_conv1d_prefill,
    "prefill": gdn.prefill,
    "metadata.plan": M.plan,
    "metadata.state_rows": M.state_rows,
    "metadata.shadow_check": M.shadow_check,
}


@pytest.mark.parametrize("name", list(DOCUMENTED))
def test_docstring_names_every_argument(name):
    fn = DOCUMENTED[name]
    doc = inspect.getdoc(fn) or ""
    missing = [p for p in inspect.signature(fn).parameters if f"``{p}``" not in doc]
    assert not missing, f"{name}'s docstring does not mention {missing}"


def test_help_decode_mtp_is_the_contract():
    """help(gdn.decode_mtp) alone says shapes, dtypes, layouts, the slot rules, what is mutated,
    the CPU and GPU error behaviour and the accuracy."""
    text = pydoc.render_doc(gdn.decode_mtp, renderer=pydoc.plaintext)
    for needle in [
        "[L, 2*H*K + HV*V]",
        "[slots, HV, V, K]",
        "[slots, HV, K, V]",
        '"vk"',
        '"kv"',
        "bf16",
        "int32/int64",
        "first_valid_slot",
        "null",
        "state_indices[i, acc_i - 1]",
        "state_indices[i, t]",
        "T_i = 0",
        "Mutated",
        "error_count",
        "ValueError",
        "before anything is written",
        "zero-filled",
        "GPU",
        "relative L2",
        "1e-5",
    ]:
        assert needle in text, f"help(gdn.decode_mtp) does not mention {needle!r}"


# ---- the guard: names, dtypes, devices and architectures ---------------------------------------


@pytest.mark.parametrize(
    "alias,canonical",
    [
        ("bf16", "bfloat16"),
        ("BF16", "bfloat16"),
        (torch.bfloat16, "bfloat16"),
        ("torch.bfloat16", "bfloat16"),
        ("fp32", "float32"),
        ("float", "float32"),
        (torch.float32, "float32"),
        (np.float32, "float32"),
        (np.dtype("float32"), "float32"),
        ("fp16", "float16"),
        ("half", "float16"),
        (torch.float16, "float16"),
        (np.float16, "float16"),
    ],
)
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_guard_accepts_dtype_aliases(alias, canonical, device):
    args = (device, 16, 48, 128, 128, 4)
    assert gdn.can_use_decode_mtp(*args, alias) == gdn.can_use_decode_mtp(*args, canonical)
    assert gdn.can_use_decode_mtp(*args, state_dtype=alias) == gdn.can_use_decode_mtp(*args, canonical)


@pytest.mark.parametrize("bad", ["float64", torch.float64, np.int32, "bf17"])
def test_guard_rejects_other_dtypes_by_name(bad):
    with pytest.raises(ValueError, match="state_dtype must be float32, bfloat16 or float16"):
        gdn.can_use_decode_mtp("cpu", 16, 32, state_dtype=bad)


def test_guard_accepts_device_strings():
    for dev in ("cuda:0", torch.device("cuda", 0), "CUDA:0", " cuda "):
        assert gdn.can_use_decode_mtp(dev, 16, 48, 128, 128, 4) == gdn.can_use_decode_mtp(
            "cuda", 16, 48, 128, 128, 4, device_index=0
        )
    assert gdn.can_use_decode_mtp(torch.device("cpu"), 16, 48)[0] == "fast"
    assert gdn.can_use_decode_mtp("cuda:3", 16, 48, device_index=3) == gdn.can_use_decode_mtp(
        "cuda", 16, 48, device_index=3
    )
    with pytest.raises(ValueError, match="disagree"):
        gdn.can_use_decode_mtp("cuda:1", 16, 48, device_index=0)
    for bad in ("cuda:x", "tpu", "mps:0"):
        with pytest.raises(ValueError, match="device must be 'cpu', 'cuda' or 'cuda:N'"):
            gdn.can_use_decode_mtp(bad, 16, 48)


@pytest.fixture
def cuda_build(monkeypatch):
    """Makes the guard believe this build has CUDA kernels for the given architectures (the arch=
    answer is decided from that list alone, so it needs neither a GPU nor a CUDA build)."""

    def build(archs: str) -> None:
        monkeypatch.setattr(gdn._C, "built_with_cuda", True)
        monkeypatch.setattr(gdn._C, "cuda_architectures", archs)

    return build


@pytest.mark.parametrize("arch", ["sm_90", "sm90", "sm_90a", "90", "9.0", "compute_90", 90, (9, 0)])
def test_guard_names_an_architecture_in_any_spelling(cuda_build, arch):
    cuda_build("90a,80")
    assert gdn.can_use_decode_mtp("cuda", 16, 48, 128, 128, 4, "bf16", arch=arch)[0] == "fast"


@pytest.mark.parametrize(
    "archs,arch,path,words",
    [
        ("90a,80", "sm_90", "fast", "sm_90a code"),
        ("90a,80", (8, 6), "fast", "sm_80 code"),  # same major, later minor: sm_80 binary
        ("90a,80", "sm_100", "fast", "compute_80 PTX"),  # later major: the PTX
        ("90a,80", "sm_75", "unsupported", "no kernel image for sm_75 (compiled architectures: 90a, 80)"),
        ("90a-real,80-real", "sm_100", "unsupported", "no kernel image for sm_100"),
        ("90a", "sm_100", "unsupported", "no kernel image for sm_100"),  # "a" PTX runs on 9.0 only
        ("80-virtual", "sm_120", "fast", "compute_80 PTX"),
        ("native", "sm_90", "unsupported", "cannot tell"),
    ],
)
def test_guard_answers_for_a_named_architecture(cuda_build, archs, arch, path, words):
    cuda_build(archs)
    got, reason = gdn.can_use_decode_mtp("cuda", 16, 48, 128, 128, 4, "bf16", arch=arch)
    assert got == path and words in reason, reason
    if path == "unsupported":
        assert "would take the fast path" in reason  # the configuration itself is fine


def test_guard_with_arch_still_applies_the_configuration_rules(cuda_build):
    cuda_build("90a,80")
    odd = gdn.can_use_decode_mtp("cuda", 16, 32, 64, 64, 4, arch="sm_90")
    assert odd[0] == "unsupported" and "K = V = 128" in odd[1]
    kv = gdn.can_use_decode_mtp("cuda", 16, 32, 128, 128, 4, state_layout="kv", arch="sm_90")
    assert kv[0] == "generic" and "slow path" in kv[1]
    assert gdn.can_use_decode_mtp("cuda", 1, 5, 128, 128, 4, arch="sm_90")[0] == "generic"
    with pytest.raises(ValueError, match="arch"):
        gdn.can_use_decode_mtp("cpu", 16, 32, arch="sm_90")
    with pytest.raises(ValueError, match="arch must name a CUDA architecture"):
        gdn.can_use_decode_mtp("cuda", 16, 32, arch="hopper")


def test_guard_with_arch_without_cuda_kernels(monkeypatch):
    monkeypatch.setattr(gdn._C, "built_with_cuda", False)
    path, reason = gdn.can_use_decode_mtp("cuda", 16, 48, 128, 128, 4, arch="sm_90")
    assert path == "unsupported"
    assert reason.startswith("this build of gdn has no CUDA kernels; on a supported GPU")


def _guard_answers():
    for device in ("cpu", "cuda"):
        for H, HV, K, S, layout in [
            (16, 48, 128, 4, "vk"),
            (16, 32, 128, 4, "kv"),
            (1, 5, 128, 2, "vk"),
            (16, 32, 64, 4, "vk"),
            (16, 32, 128, 17, "vk"),
            (4, 6, 128, 1, "vk"),
            (0, 16, 128, 1, "vk"),
        ]:
            yield gdn.can_use_decode_mtp(device, H, HV, K, K, S, "bf16", state_layout=layout)


def test_guard_reasons_are_one_clean_sentence():
    for path, reason in _guard_answers():
        assert path in ("fast", "generic", "unsupported")
        assert reason and reason == reason.strip() and not reason.endswith((":", ";", "."))
        for artefact in (": :", "::", ": ;", ";;", "  ", ". "):
            assert artefact not in reason, reason


def test_guard_without_a_usable_device_says_why_and_what_the_configuration_takes():
    usable = gdn._C.built_with_cuda and gdn.cuda_device_count() > 0 and gdn.cuda_kernels_available(0)[0]
    if usable:
        pytest.skip("a usable CUDA device is present")
    path, reason = gdn.can_use_decode_mtp("cuda", 16, 48, 128, 128, 4, "bf16")
    assert path == "unsupported"
    assert "would take the fast path" in reason and "CUDA" in reason


# ---- python -m gdn -------------------------------------------------------------------------------


def _cli(*args, python_flags=()):
    return subprocess.run(
        [sys.executable, *python_flags, "-m", "gdn", *args],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=300,
    )


def test_cli_version():
    result = _cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"gdn {gdn.__version__}"


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["--help", "help"])
def test_cli_help_lists_every_command(flag):
    result = _cli(flag)
    assert result.returncode == 0, result.stderr
    for command in ("all", "info", "selfcheck", "demo", "help", "--cmake-dir", "--include-dir", "--version"):
        assert re.search(rf"(^|\s|{{|,){re.escape(command)}(\s|,|}}|$)", result.stdout), command


@pytest.mark.skipif(sys.version_info < (3, 10), reason="needs sys.orig_argv (Python 3.10+)")
@pytest.mark.parametrize("flag", ["--help", "-h", "help"])
def test_cli_help_is_printed_once_without_torch(flag):
    """The help is the module docstring alone (no argparse sections repeating it) and, like the
    path queries, does not import torch."""
    result = _cli(flag, python_flags=("-X", "importtime"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.count("python -m gdn [") == 1, result.stdout
    assert "positional arguments" not in result.stdout and result.stdout.count("--cmake-dir") == 3
    imported = {
        line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
    }
    assert "gdn" in imported and "torch" not in imported, "python -m gdn " + flag + " imported torch"


@pytest.mark.skipif(sys.version_info < (3, 10), reason="needs sys.orig_argv (Python 3.10+)")
@pytest.mark.parametrize(
    "flag,expected",
    [("--cmake-dir", gdn.cmake_dir()), ("--include-dir", gdn.include_dir()), ("--version", f"gdn {gdn.__version__}")],
)
def test_cli_path_queries_do_not_import_torch(flag, expected):
    """Build systems run these: they print one line and never import torch (-X importtime lists
    every module the interpreter imported)."""
    result = _cli(flag, python_flags=("-X", "importtime"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == expected
    imported = {
        line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if line.startswith("import time:")
    }
    assert "gdn" in imported
    assert not {m for m in imported if m == "torch" or m.startswith("torch.")}, (
        "python -m gdn " + flag + " imported torch"
    )


def test_gpu_skip_reason_says_no_gpu():
    """Without a GPU the CUDA tests skip saying "no GPU" (not what the CUDA runtime reports about a
    missing driver)."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: its tests run")
    assert cuda_skip_reason() == "no GPU (torch sees no CUDA device)"
