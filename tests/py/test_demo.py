"""python -m gdn demo: a short CPU run prints PASS; the check fails when the conv rollback is
broken; the dense layers are batch-invariant by construction; CUDA variants (graphs on/off) skip
without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

import gdn

torch = pytest.importorskip("torch")

from gdn import demo  # noqa: E402
from gdn._demo_model import exact_linear, exact_rms_norm, int8_weight  # noqa: E402

SHORT = ["--repeats", "1", "--requests", "4", "--min-prompt", "2", "--max-prompt", "7", "--new-tokens", "14",
         "--layers", "3", "--groups", "2", "--no-progress"]

CUDA = torch.cuda.is_available() and gdn._C.built_with_cuda and gdn.cuda_device_count() > 0
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device and a CUDA build of gdn")


def test_short_cpu_demo_passes(capsys):
    assert demo.main(SHORT) == 0
    out = capsys.readouterr().out
    assert "PASS (speculative == plain decoding)" in out
    assert "acceptance" in out and "metadata" in out and "decode_mtp" in out and "conv" in out


def test_tokens_major_conv_layout_and_three_groups(capsys):
    assert demo.main(SHORT + ["--conv-layout", "tokens_major", "--groups", "3", "--num-spec", "2",
                              "--seed", "5"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_check_fails_when_the_conv_rollback_is_broken(monkeypatch, capsys):
    # Reading the conv window at offset 0 instead of acc - 1 keeps rejected drafts in the history:
    # the speculative run must then diverge from plain decoding and the demo must say FAIL.
    real = gdn.causal_conv1d_update

    def no_rollback(*args, num_accepted_tokens=None, **kw):
        return real(*args, num_accepted_tokens=None, **kw)

    monkeypatch.setattr(gdn, "causal_conv1d_update", no_rollback)
    assert demo.main(SHORT + ["--new-tokens", "24"]) == 1
    out = capsys.readouterr().out
    assert "FAIL (speculative != plain decoding)" in out
    assert "first difference" in out


@pytest.mark.parametrize("mode", ["write-all", "replay"])
def test_mixed_spec_and_plain_rows_pass_in_both_state_modes(capsys, mode):
    assert demo.main(SHORT + ["--new-tokens", "24", "--mixed-every", "2", "--state-mode",
                              mode]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "mixed steps  :" in out
    if mode == "replay":
        assert "state modes" in out and "in both state modes" in out


def test_check_fails_when_plain_rows_read_a_stale_state(monkeypatch, capsys):
    # A non-spec row that reads column 0 (where the previous verify step started) instead of its
    # source column acc - 1 continues from a stale state: the run must diverge and say FAIL.
    real = gdn.decode_mtp

    def stale(mixed_qkv, a, b, A_log, dt_bias, state, state_indices, *args, **kw):
        if state_indices.shape[1] == 2:  # the demo's non-spec rows: [destination, source]
            state_indices = state_indices[:, :1].expand(-1, 2).contiguous()
        return real(mixed_qkv, a, b, A_log, dt_bias, state, state_indices, *args, **kw)

    monkeypatch.setattr(gdn, "decode_mtp", stale)
    assert demo.main(SHORT + ["--new-tokens", "30", "--mixed-every", "2", "--num-spec", "3"]) == 1
    assert "FAIL (speculative != plain decoding)" in capsys.readouterr().out


def test_check_fails_when_replay_counts_are_dropped(monkeypatch, capsys):
    # Replay verify reads its replay counts from the metadata builder (replay mode); replaying
    # nothing instead of the accepted tokens restarts from a stale checkpoint: the replay run must
    # diverge and the demo must say FAIL.
    real = gdn.decode_mtp_replay

    def nothing_replayed(*args, num_accepted_tokens=None, **kw):
        return real(*args, num_accepted_tokens=torch.zeros_like(num_accepted_tokens), **kw)

    monkeypatch.setattr(gdn, "decode_mtp_replay", nothing_replayed)
    assert demo.main(SHORT + ["--new-tokens", "24", "--state-mode", "replay"]) == 1
    out = capsys.readouterr().out
    assert "FAIL (speculative != plain decoding)" in out and "replay request" in out


def test_dense_layers_are_batch_invariant():
    g = torch.Generator().manual_seed(0)
    w = int8_weight((128, 96), 128 ** -0.5, g)
    norm = torch.ones(128, dtype=torch.float64)
    x = torch.randn(37, 128, generator=g) * torch.logspace(-8, 2, 37).unsqueeze(1)
    batched = exact_linear(exact_rms_norm(x, norm), w)
    for i in range(x.shape[0]):
        row = exact_linear(exact_rms_norm(x[i:i + 1], norm), w)
        assert torch.equal(row, batched[i:i + 1]), f"row {i} differs from the batched result"
    # Exact, not merely consistent: float64 sums in reverse order give the same bits.
    q = exact_rms_norm(x, norm)
    qb = q.clamp(-255, 255).to(torch.bfloat16).to(torch.float64)
    qb = torch.where(qb.abs() < 2.0 ** -16, torch.zeros_like(qb), qb)
    reverse = (qb.flip(1) @ w.flip(0)).to(torch.float32)
    assert torch.equal(reverse, batched)


def test_help_explains_every_option():
    text = demo.build_parser().format_help()
    for action in demo.build_parser()._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 15, action.option_strings
    for option in ("--device", "--graphs", "--num-spec", "--requests", "--new-tokens", "--groups",
                   "--conv-layout", "--layer-strength"):
        assert option in text
    r = subprocess.run([sys.executable, "-m", "gdn", "demo", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "--graphs" in r.stdout


def test_bad_arguments_are_refused(capsys):
    assert demo.main(["--graphs"]) == 2
    assert demo.main(["--groups", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--graphs needs --device cuda" in err and "groups must be" in err


@needs_cuda
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_short_cuda_demo_passes(graphs, capsys):
    args = SHORT + ["--device", "cuda"] + (["--graphs"] if graphs else [])
    assert demo.main(args) == 0
    out = capsys.readouterr().out
    assert "PASS (speculative == plain decoding)" in out


def test_speed_up_is_the_median_of_timed_runs_after_a_warm_up(capsys):
    """With repeats, the speed-up line says it is a median over warmed-up runs; with one run it
    says it is not warmed up. Every repeat must reproduce the tokens (PASS)."""
    assert demo.main(["--repeats", "3"] + SHORT[2:]) == 0
    text = capsys.readouterr().out
    assert "speed-up     :" in text and "median of 2 timed runs after a warm-up" in text
    assert demo.main(SHORT) == 0
    assert "one run, not warmed up" in capsys.readouterr().out
