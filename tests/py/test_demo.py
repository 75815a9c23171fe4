"""python -m gdn demo: a short CPU run (rows taken over by late requests, some with one-token
prompts) prints PASS in both state modes, with prompts prefilled by the prefill calls (the
default; their tokens equal token-by-token prefill's) and token by token; the check fails when
the conv rollback is broken, when non-spec rows read a stale state, when replay counts are
dropped, and when fresh rows are not started from a zero state (then because of the garbage a
finished request leaves behind), by zeroing or by a null initial slot of the prefill call; the
dense layers are batch-invariant by construction; CUDA variants (graphs on/off, both prefill
paths) skip without a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

import gdn

torch = pytest.importorskip("torch")

from gdn import demo  # noqa: E402
from reference_torch import cuda_skip_reason  # noqa: E402 (needs torch)
from gdn._demo_model import (  # noqa: E402
    DecodePath,
    GDNCache,
    exact_linear,
    exact_rms_norm,
    int8_weight,
)

# 4 rows; --late-requests defaults to 4 more, of which late requests 0 and 3 (requests 4 and 7)
# have one-token prompts.
SHORT = [
    "--repeats",
    "1",
    "--requests",
    "4",
    "--min-prompt",
    "2",
    "--max-prompt",
    "7",
    "--new-tokens",
    "14",
    "--layers",
    "3",
    "--groups",
    "2",
    "--no-progress",
]

_CUDA_REASON = cuda_skip_reason()
CUDA = _CUDA_REASON is None
needs_cuda = pytest.mark.skipif(not CUDA, reason=f"CUDA: {_CUDA_REASON}")


def test_short_cpu_demo_passes(capsys):
    assert demo.main(SHORT) == 0
    out = capsys.readouterr().out
    assert "PASS (speculative == plain decoding)" in out
    assert "acceptance" in out and "metadata" in out and "decode_mtp" in out and "conv" in out


def test_tokens_major_conv_layout_and_three_groups(capsys):
    assert demo.main(SHORT + ["--conv-layout", "tokens_major", "--groups", "3", "--num-spec", "2", "--seed", "5"]) == 0
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
    assert demo.main(SHORT + ["--new-tokens", "24", "--mixed-every", "2", "--state-mode", mode]) == 0
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


def _fresh_rows_spy(monkeypatch):
    """Records, per non-spec step, the metadata's decode count and the fresh rows it gave."""
    seen = []
    real = DecodePath.non_spec_rows

    def spy(self, md, timer):
        rows = real(self, md, timer)
        seen.append((md.num_decodes, len(rows.fresh)))
        return rows

    monkeypatch.setattr(DecodePath, "non_spec_rows", spy)
    return seen


@pytest.mark.parametrize("mode", ["write-all", "replay"])
def test_rows_taken_over_by_late_requests_pass_in_both_state_modes(monkeypatch, capsys, mode):
    # 4 rows, 6 late requests: rows change hands 6 times; late requests 0 and 3 have one-token
    # prompts. Freed blocks hold garbage, so this passes only if the metadata starts every fresh
    # request without a state, also where its first (or only) prompt token comes after decode
    # rows in a step without spec rows.
    seen = _fresh_rows_spy(monkeypatch)
    assert demo.main(SHORT + ["--late-requests", "6", "--state-mode", mode]) == 0
    out = capsys.readouterr().out
    assert (
        "recycled     : 6 rows taken over by new requests (2 with one-token prompts); 10 requests ran on 4 rows" in out
    )
    assert "in every run the metadata started all 10 requests from a zero state" in out
    assert "PASS (speculative == plain decoding)" in out
    if mode == "replay":
        assert "in both state modes" in out
    # Fresh rows that came after decode rows in their step (what a misclassifying builder would
    # have handed a stale source) did occur.
    assert any(decodes > 0 and fresh > 0 for decodes, fresh in seen)


def _clean_start(monkeypatch):
    """Pools start zeroed: only the garbage a finished request leaves behind is stale."""
    real_init = GDNCache.__init__

    def init(self, *args, **kw):
        real_init(self, *args, **kw)
        for pool in self.ssm + self.conv:
            pool.zero_()

    monkeypatch.setattr(GDNCache, "__init__", init)


@pytest.mark.parametrize("mode", ["write-all", "replay"])
def test_check_fails_when_fresh_rows_read_the_previous_occupants_garbage(monkeypatch, capsys, mode):
    # A consumer that ignores has_initial_state (no zeroing) runs a late request from whatever
    # its row's previous request left: the run-specific garbage. Pools start clean here, so the
    # first requests are unaffected and every difference is a late request's.
    _clean_start(monkeypatch)
    monkeypatch.setattr(GDNCache, "zero_blocks", lambda self, group, blocks: None)
    args = SHORT + ["--state-mode", mode]
    assert demo.main(args) == 1
    out = capsys.readouterr().out
    assert "FAIL (speculative != plain decoding)" in out
    diffs = [line for line in out.splitlines() if "first difference" in line]
    assert diffs and all("(late" in line for line in diffs), diffs

    # The same consumer passes when freed blocks hold zeros instead of garbage: the failure
    # above comes from the garbage, which the demo writes exactly where fresh rows read.
    def zeros_instead_of_garbage(self, blocks):
        for li in range(self.cfg.layers):
            b = blocks[self.cfg.group_of(li)]
            self.ssm[li][b] = 0.0
            self.conv[li][b] = 0.0

    monkeypatch.setattr(GDNCache, "fill_garbage", zeros_instead_of_garbage)
    assert demo.main(args) == 0
    assert "PASS" in capsys.readouterr().out


@pytest.mark.parametrize("prefill", ["token-by-token", "calls"])
def test_check_fails_when_first_requests_read_unwritten_blocks(monkeypatch, capsys, prefill):
    # Blocks start as garbage too: without zeroing, even the first requests (no row changes
    # hands) start from it and the check fails. With prefill calls the first prompts (2 tokens
    # or more) start from a null initial slot and need no zeroing; the plain run that prefills
    # token by token reads the garbage, and the check against it fails (bit-exact on the CPU).
    monkeypatch.setattr(GDNCache, "zero_blocks", lambda self, group, blocks: None)
    assert demo.main(SHORT + ["--late-requests", "0", "--prefill", prefill]) == 1
    out = capsys.readouterr().out
    if prefill == "token-by-token":
        assert "FAIL (speculative != plain decoding)" in out
    else:
        assert "FAIL (prefill calls != token-by-token prefill" in out
        diffs = [line for line in out.splitlines() if "first difference" in line]
        assert diffs and all(line.lstrip().startswith("token-by-token") for line in diffs), diffs


def _record_runs(monkeypatch):
    """Records the tokens of every run main() makes: (kind, prefill calls, replay) -> tokens."""
    runs = {}
    real_plain, real_spec = demo.run_plain, demo.run_speculative

    def plain(model, prompts, args, progress, prefill_calls=False, garbage_run=0):
        tokens, stats = real_plain(model, prompts, args, progress, prefill_calls=prefill_calls, garbage_run=garbage_run)
        runs.setdefault(("plain", prefill_calls, False), tokens)
        return tokens, stats

    def spec(model, prompts, args, progress, replay=False, prefill_calls=False):
        tokens, stats, note = real_spec(model, prompts, args, progress, replay=replay, prefill_calls=prefill_calls)
        runs.setdefault(("speculative", prefill_calls, replay), tokens)
        return tokens, stats, note

    monkeypatch.setattr(demo, "run_plain", plain)
    monkeypatch.setattr(demo, "run_speculative", spec)
    return runs


def _spy_prefill_calls(monkeypatch):
    """Records every gdn.prefill / gdn.causal_conv1d_prefill call: (name, token counts of its
    requests, initial slot ids)."""
    calls = []
    for name in ("prefill", "causal_conv1d_prefill"):
        real = getattr(gdn, name)

        def spy(*args, _real=real, _name=name, **kw):
            cu = args[5 if _name == "causal_conv1d_prefill" else 8].cpu().tolist()
            initial = args[3 if _name == "causal_conv1d_prefill" else 6].cpu().tolist()
            calls.append((_name, [e - b for b, e in zip(cu, cu[1:])], initial))
            return _real(*args, **kw)

        monkeypatch.setattr(gdn, name, spy)
    return calls


@pytest.mark.parametrize("mode", ["write-all", "replay"])
def test_prefill_calls_pass_and_equal_token_by_token_prefill(monkeypatch, capsys, mode):
    # The default --prefill calls: whole prompts through gdn.causal_conv1d_prefill + gdn.prefill
    # (one call each per layer and step), rows taken over by late requests (some with one-token
    # prompts, which go through the decode path). It must PASS, print the time to first token
    # both ways, and every run's tokens must equal those of a --prefill token-by-token demo.
    runs = _record_runs(monkeypatch)
    calls = _spy_prefill_calls(monkeypatch)
    args = SHORT + ["--late-requests", "6", "--state-mode", mode]
    assert demo.main(args) == 0
    out = capsys.readouterr().out
    assert "PASS (speculative == plain decoding), prefill calls == token-by-token prefill" in out
    assert "first token  : plain greedy, prefill calls: median" in out
    assert "plain greedy, token by token: median" in out and "sooner" in out
    assert "in every run the metadata started all 10 requests from a zero state" in out
    # Prefill calls ran, in pairs, only on rows of more than one token, all fresh (a null
    # initial slot: the demo's NULL_BLOCK 0, first_valid_slot 1).
    assert calls and len(calls) % 2 == 0
    assert {name for name, _, _ in calls} == {"prefill", "causal_conv1d_prefill"}
    for _, lengths, initial in calls:
        assert lengths and all(n > 1 for n in lengths)
        assert all(i == 0 for i in initial)
    # 3 layers: every step with prefill rows makes 3 calls of each.
    assert sum(name == "prefill" for name, _, _ in calls) % 3 == 0
    with_calls = dict(runs)
    assert ("plain", False, False) in with_calls  # the token-by-token reference ran too

    runs.clear()
    calls.clear()
    assert demo.main(args + ["--prefill", "token-by-token"]) == 0
    out = capsys.readouterr().out
    assert "PASS (speculative == plain decoding)" in out and "prefill calls ==" not in out
    assert not calls  # the old path makes no prefill call
    reference = runs[("plain", False, False)]
    assert set(runs) == {("plain", False, False), ("speculative", False, False)} | (
        {("speculative", False, True)} if mode == "replay" else set()
    )
    for key, tokens in list(with_calls.items()) + list(runs.items()):
        assert tokens == reference, key


@pytest.mark.parametrize("mode", ["write-all", "replay"])
def test_check_fails_when_prefill_ignores_has_initial_state(monkeypatch, capsys, mode):
    # A consumer that hands a fresh prefill row its destination as the initial slot (ignoring
    # has_initial_state) runs the prompt from the garbage its blocks hold: the runs (each with its
    # own garbage) diverge and the check fails.
    real = gdn.prefill

    def from_destination(mixed_qkv, a, b, A_log, dt_bias, state, initial, final, *args, **kw):
        return real(mixed_qkv, a, b, A_log, dt_bias, state, final, final, *args, **kw)

    monkeypatch.setattr(gdn, "prefill", from_destination)
    assert demo.main(SHORT + ["--state-mode", mode]) == 1
    assert "FAIL (speculative != plain decoding)" in capsys.readouterr().out


def test_dense_layers_are_batch_invariant():
    g = torch.Generator().manual_seed(0)
    w = int8_weight((128, 96), 128**-0.5, g)
    norm = torch.ones(128, dtype=torch.float64)
    x = torch.randn(37, 128, generator=g) * torch.logspace(-8, 2, 37).unsqueeze(1)
    batched = exact_linear(exact_rms_norm(x, norm), w)
    for i in range(x.shape[0]):
        row = exact_linear(exact_rms_norm(x[i : i + 1], norm), w)
        assert torch.equal(row, batched[i : i + 1]), f"row {i} differs from the batched result"
    # Exact, not merely consistent: float64 sums in reverse order give the same bits.
    q = exact_rms_norm(x, norm)
    qb = q.clamp(-255, 255).to(torch.bfloat16).to(torch.float64)
    qb = torch.where(qb.abs() < 2.0**-16, torch.zeros_like(qb), qb)
    reverse = (qb.flip(1) @ w.flip(0)).to(torch.float32)
    assert torch.equal(reverse, batched)


def test_help_explains_every_option():
    text = demo.build_parser().format_help()
    for action in demo.build_parser()._actions:
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 15, action.option_strings
    for option in (
        "--device",
        "--graphs",
        "--num-spec",
        "--requests",
        "--late-requests",
        "--new-tokens",
        "--groups",
        "--conv-layout",
        "--layer-strength",
    ):
        assert option in text
    r = subprocess.run([sys.executable, "-m", "gdn", "demo", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--graphs" in r.stdout


def test_bad_arguments_are_refused(capsys):
    assert demo.main(["--graphs"]) == 2
    assert demo.main(["--groups", "1", "--no-progress"]) == 2
    assert demo.main(["--late-requests", "-1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--graphs needs --device cuda" in err and "groups must be" in err
    assert "--late-requests must be >= 0" in err


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("prefill", ["calls", "token-by-token"])
@pytest.mark.parametrize("mode", ["write-all", "replay"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_short_cuda_demo_passes(graphs, mode, prefill, capsys):
    # With prefill calls, PASS compares the runs that all prefill with the CUDA prefill kernel
    # (bf16 operands); agreement with token-by-token prefill is reported, not required.
    args = SHORT + ["--device", "cuda", "--state-mode", mode, "--prefill", prefill] + (["--graphs"] if graphs else [])
    assert demo.main(args) == 0
    out = capsys.readouterr().out
    assert "PASS (speculative == plain decoding)" in out
    if prefill == "calls":
        assert "requests generated exactly the tokens of token-by-token prefill" in out
        assert "first token  : plain greedy, prefill calls" in out


@pytest.mark.gpu
@needs_cuda
def test_cuda_rows_taken_over_with_graphs(capsys):
    # Late requests (some with one-token prompts) take over freed rows; pure verify steps replay
    # the CUDA graph, steps with prefilling rows run eagerly. A stale read would differ (PASS
    # fails) or, with a null source, raise from the kernels' error count.
    assert demo.main(SHORT + ["--device", "cuda", "--graphs", "--late-requests", "6"]) == 0
    out = capsys.readouterr().out
    assert "recycled     : 6 rows taken over by new requests (2 with one-token prompts)" in out
    assert "PASS (speculative == plain decoding)" in out


def test_speed_up_is_the_median_of_timed_runs_after_a_warm_up(capsys):
    """With repeats, the speed-up line says it is a median over warmed-up runs; with one run it
    says it is not warmed up. Every repeat must reproduce the tokens (PASS)."""
    assert demo.main(["--repeats", "3"] + SHORT[2:]) == 0
    text = capsys.readouterr().out
    assert "speed-up     :" in text and "median of 2 timed runs after a warm-up" in text
    assert demo.main(SHORT) == 0
    assert "one run, not warmed up" in capsys.readouterr().out
