"""usage: python -m gdn [all | info | selfcheck | demo ... | help]
                     [--version | --cmake-dir | --include-dir | -h | --help]

commands:
  all        (default) info, then selfcheck
  info       the build: version, CUDA kernels and architectures, devices, supported set
  selfcheck  decode_mtp (CPU) against the float64 reference on random data
  demo       the speculative-decoding demo on a tiny hybrid model (python -m gdn demo --help)
  help       this help

options:
  --version      print the version
  --cmake-dir    print the CMake package dir (gdn_DIR for find_package(gdn))
  --include-dir  print the C++ include dir (#include <gdn/...>)
  -h, --help     this help

help, --help, --version, --cmake-dir and --include-dir print without importing torch.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

import gdn


def info() -> None:
    print(f"gdn {gdn.__version__}")
    cuda = gdn._C.built_with_cuda
    print(
        f"  CUDA kernels built : {'yes' if cuda else 'no'}"
        + (f" (architectures {gdn._C.cuda_architectures})" if cuda else "")
    )
    n = gdn.cuda_device_count()
    print(f"  CUDA devices       : {n}")
    for d in range(n):
        ok, why = gdn.cuda_kernels_available(d)
        print(f"    device {d}: {'usable' if ok else 'not usable'} - {why}")
    print(f"  head ratios (fast) : {gdn.supported_head_ratios()} (other integral ratios: generic path)")
    print(f"  state dtypes       : {gdn.supported_state_dtypes()}")
    print(f"  CUDA head dims     : {gdn._C.cuda_head_dims()}, S <= {gdn._C.cuda_max_spec_columns}")
    print(f"  C++ headers        : {gdn.include_dir()}")
    print(f"  CMake package      : {gdn.cmake_dir()}")
    ops = getattr(gdn, "ops", None)  # imported with gdn when torch is installed
    if ops is not None:
        print(f"  torch op kernels   : {ops.KERNELS} ({ops.KERNELS_REASON})")


def selfcheck(seed: int = 0) -> bool:
    """decode_mtp (CPU) against the float64 reference on fresh random data; True when within
    bars."""
    from gdn.decode_mtp import decode_mtp_reference

    rng = np.random.default_rng(seed)
    ok = True
    print("self-check: decode_mtp (CPU, fp32) vs float64 reference")
    for H, HV, S in [(2, 4, 3), (2, 6, 4), (1, 8, 2), (2, 10, 3)]:
        K = V = 32
        N, slots = 3, 16
        T = rng.integers(1, S + 1, size=N)
        T[1] = 0  # a padded row
        cu = np.concatenate([[0], np.cumsum(T)]).astype(np.int32)
        L = int(cu[-1])
        idx = rng.permutation(slots)[: N * S].reshape(N, S).astype(np.int32)
        acc = rng.integers(1, S + 1, size=N).astype(np.int32)
        f32 = lambda *s, sc=1.0: (sc * rng.standard_normal(s)).astype(np.float32)  # noqa: E731
        # Everything but the state and out, the same for the kernel and the reference.
        args = dict(
            mixed_qkv=f32(L, 2 * H * K + HV * V),
            a=f32(L, HV),
            b=f32(L, HV),
            A_log=f32(HV, sc=0.5),
            dt_bias=f32(HV, sc=0.1),
            state_indices=idx,
            cu_seqlens=cu,
            z=f32(L, HV, V),
            norm_weight=f32(V),
            num_accepted_tokens=acc,
        )
        state = f32(slots, HV, V, K, sc=0.1)
        out = np.full((L, HV, V), np.nan, np.float32)
        ref_out, ref_state = decode_mtp_reference(**args, state=state)
        new_state = state.copy()
        gdn.decode_mtp(**args, state=new_state, out=out)
        e_out = np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)
        e_state = np.linalg.norm(new_state - ref_state) / np.linalg.norm(ref_state)
        good = e_out <= 1e-5 and e_state <= 1e-5
        ok &= bool(good)
        print(
            f"  H={H:2d} HV={HV:2d} ratio={HV // H} S={S}: rel L2 error out {e_out:.2e}, "
            f"state {e_state:.2e} -> {'ok' if good else 'FAIL'}"
        )
    print("self-check:", "PASS" if ok else "FAIL")
    return ok


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "demo":  # the demo parses its own options
        from gdn import demo

        return demo.main(argv[1:])
    # The module docstring is the whole help (argparse's generated sections would repeat it).
    parser = argparse.ArgumentParser(prog="python -m gdn", usage=argparse.SUPPRESS, add_help=False)
    parser.add_argument("command", nargs="?", default="all", choices=["all", "info", "selfcheck", "demo", "help"])
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("--version", action="version", version=f"gdn {gdn.__version__}")
    parser.add_argument("--cmake-dir", action="store_true")
    parser.add_argument("--include-dir", action="store_true")
    args = parser.parse_args(argv)
    if args.help or args.command == "help":
        print((__doc__ or "").rstrip())
        return 0
    if args.cmake_dir:
        print(gdn.cmake_dir())
        return 0
    if args.include_dir:
        print(gdn.include_dir())
        return 0
    if args.command == "demo":
        from gdn import demo

        return demo.main([])
    if args.command in ("all", "info"):
        info()
    if args.command in ("all", "selfcheck"):
        return 0 if selfcheck() else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
