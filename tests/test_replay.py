"""The acceptance replay (speculative/replay.py, `mtp bench --replay_acceptance`): benchmark-only drafts taken
from the target's own greedy continuation at given per-position rates. The engine's output stays plain greedy's,
the accepted counts follow the rates, and the bench report says the acceptance was replayed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import PROMPTS, greedy, make_engine, reference, run_to_end
from mtp_core.speculative.replay import R1_RATES, ReplayDrafts, parse_rates

ROOT = Path(__file__).resolve().parent.parent


def test_rates_parse_and_refuse():
    assert parse_rates("r1") == R1_RATES == (0.92, 0.72, 0.36)
    assert parse_rates(" 0.5,1 ") == (0.5, 1.0)
    for bad in ("", "x", "0.5,1.5", "-0.1"):
        with pytest.raises(ValueError, match="replay_acceptance"):
            parse_rates(bad)


def test_a_row_keeps_the_continuation_until_its_first_miss():
    cont = list(range(10, 30))
    seq = SimpleNamespace(prompt_ids=[1, 2], output_ids=[10, 11, 12], request_id=7)
    always = ReplayDrafts((1.0, 1.0, 1.0), {(1, 2): cont}, vocab_size=100)
    assert always(seq, [0, 0, 0]) == [13, 14, 15]                 # output tokens 3, 4, 5 of the continuation
    never_second = ReplayDrafts((1.0, 0.0, 1.0), {(1, 2): cont}, vocab_size=100)
    assert never_second(seq, [0, 0, 0]) == [13, 15, 16]           # wrong from the first miss on
    other = SimpleNamespace(prompt_ids=[9], output_ids=[], request_id=8)
    assert always(other, [4, 5]) == [4, 5]                        # a prompt it has no continuation for
    seq.output_ids = cont[:19]
    assert always(seq, [0, 0]) == [cont[19], 0]                   # past the continuation: the drafter's own


def test_the_engine_output_stays_greedy_and_acceptance_follows_the_rates(tiny1_model):
    """Eagle K=3 on the tiny checkpoint (its own head accepts little); with the replay at (0.8, 0.5, 0.5) the
    drafts verified per position are accepted at about those rates (unconditional: .8, .4, .2), and every token
    is plain greedy's."""
    model, prompts, n = tiny1_model, PROMPTS[:6], 48
    conts = {tuple(p): reference(model, p, n + 8) for p in prompts}
    eng = make_engine(model, nextn=3, mode="eagle", spec=dict(draft_len_policy="fixed"))
    eng.spec.replay = ReplayDrafts((0.8, 0.5, 0.5), conts, model.config.vocab_size, seed=1)
    seqs = run_to_end(eng, prompts, greedy(n))
    for p, s in zip(prompts, seqs):
        assert s.output_ids == reference(model, p, n)
    st = eng.stats
    got = [a / b for a, b in zip(st.accepted_per_position, st.proposed_per_position)]
    assert got == pytest.approx([0.8, 0.4, 0.2], abs=0.08), got
    assert eng.spec.replay.num_replaced > 0


def test_bench_labels_a_replayed_run(tmp_path, tiny1_dir):
    ds = tmp_path / "d.jsonl"
    ds.write_text("".join(json.dumps({"task_id": i, "input_ids": p, "output_tokens": 24}) + "\n"
                          for i, p in enumerate(PROMPTS[:3])))
    out = tmp_path / "r.json"
    res = subprocess.run([sys.executable, "-m", "cli", "bench", "--model_dir", str(tiny1_dir), "--dataset", str(ds),
                          "--num_threads", "1", "--warmup", "0", "--spec_decode_algo", "MTP",
                          "--spec_decode_max_draft_len", "2", "--replay_acceptance", "r1", "--report_json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "replayed at 0.92 / 0.72 / 0.36" in res.stdout and "benchmark only" in res.stderr
    assert json.loads(out.read_text())["replay_acceptance"]["rates"] == [0.92, 0.72, 0.36]
    res = subprocess.run([sys.executable, "-m", "cli", "bench", "--model_dir", str(tiny1_dir), "--dataset", str(ds),
                          "--num_threads", "1", "--replay_acceptance", "r1"], cwd=ROOT, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode != 0 and "turn MTP on" in res.stderr
