"""The vLLM peer's parts that run without vLLM: prompt preparation, prompt files, the comparison and its
table on made-up rounds, the alternation of rounds, and the missing-venv error. Nothing here needs vLLM."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import compare_vllm as cv  # noqa: E402
import peer_vllm as pv  # noqa: E402


def _round(ids: list[list[int]], tok_s: list[float], al=None) -> dict:
    return {"requests": [{"output_ids": i, "wall_s": len(i) / t, "tok_s": t} for i, t in zip(ids, tok_s)],
            "acceptance_length": al}


A, B, C = [5, 6, 7, 8], [9, 9, 9, 9], [4, 3, 2, 1]


def test_compare_counts_same_ids_and_takes_pooled_medians() -> None:
    ours = [_round([A, B, C], [100, 110, 120], 3.0), _round([A, B, C], [90, 130, 140], 3.2)]
    # prompt 1 differs in round 2 only (position 2), prompt 2 never matches (position 0)
    peer = [_round([A, B, [0, 3, 2, 1]], [200, 210, 220], 3.1),
            _round([A, [9, 9, 1, 9], [0, 3, 2, 1]], [180, 240, 260], 3.1)]
    row = cv.compare_setting(3, ours, peer, {"load_s": 71.5, "warmup_s": 2.0})
    assert row["same_ids"] == 1 and row["num_prompts"] == 3 and row["ours_deterministic"] == 3
    assert row["first_differences"] == [{"prompt": 1, "position": 2, "ours": [9, 9], "vllm": [1, 9]},
                                        {"prompt": 2, "position": 0, "ours": C, "vllm": [0, 3, 2, 1]}]
    assert row["ours_tok_s_median"] == pytest.approx(115.0)      # median of 90,100,110,120,130,140
    assert row["vllm_tok_s_median"] == pytest.approx(215.0)
    assert row["ours_over_vllm"] == pytest.approx(115 / 215)
    assert row["ours_al"] == pytest.approx(3.1) and row["vllm_al"] == pytest.approx(3.1)
    assert row["ours_tok_s_per_round"] == [pytest.approx(110.0), pytest.approx(120.0)]
    table = cv.format_table([row])
    line = next(x for x in table.splitlines() if x.startswith("eagle K=3 "))
    # best of rounds per prompt: ours 100, 130, 140 -> 130; vLLM 200, 240, 260 -> 240
    assert row["ours_tok_s_best"] == pytest.approx(130.0) and row["vllm_tok_s_best"] == pytest.approx(240.0)
    assert line.split() == ["eagle", "K=3", "115.0", "215.0", "0.53x", "130.0", "240.0", "0.54x", "3.10", "3.10",
                            "1/3", "71.5"]
    assert "eagle K=3: vLLM's ids differ from ours at prompt:position 1:2, 2:0" in table


def test_compare_flags_our_own_nondeterminism_and_bad_rounds() -> None:
    ours = [_round([A, B], [1, 1]), _round([A, C], [1, 1])]
    peer = [_round([A, B], [2, 2]), _round([A, B], [2, 2])]
    row = cv.compare_setting(0, ours, peer)
    assert row["ours_deterministic"] == 1 and row["same_ids"] == 2
    assert row["vllm_al"] is None and row["vllm_load_s"] is None
    assert "nextn=0" in cv.format_table([row]) and " - " in cv.format_table([row])
    with pytest.raises(ValueError, match="different numbers"):
        cv.compare_setting(0, ours, [_round([A], [2])])
    with pytest.raises(ValueError, match="no measured rounds"):
        cv.compare_setting(0, ours, [])


class _FakePeer:
    def __init__(self, K: int, log: list) -> None:
        self.K, self.log, self.info, self.closed = K, log, {"load_s": 60.0 + K, "warmup_s": 1.0}, False

    def run_round(self) -> dict:
        self.log.append(("vllm", self.K))
        return _round([A, B], [200.0, 200.0], 2.5 if self.K else None)


class _FakeOurs:
    def __init__(self, log: list) -> None:
        self.log = log

    def run_round(self, K, prompts, output_tokens, warmup) -> dict:
        self.log.append(("ours", K))
        return _round([A, B], [100.0, 100.0], 2.5 if K else None)


def test_rounds_alternate_and_each_peer_is_loaded_once_and_closed() -> None:
    log, peers = [], []

    def start(K):
        peers.append(_FakePeer(K, log))
        peers[-1].close = lambda p=peers[-1]: setattr(p, "closed", True)
        return peers[-1]

    rows = cv.run_comparison(_FakeOurs(log), start, [0, 3], 3, [[1, 2]], 4)
    assert log == [("ours", 0), ("vllm", 0), ("vllm", 0), ("ours", 0), ("ours", 0), ("vllm", 0),
                   ("ours", 3), ("vllm", 3), ("vllm", 3), ("ours", 3), ("ours", 3), ("vllm", 3)]
    assert [p.K for p in peers] == [0, 3] and all(p.closed for p in peers)
    assert [r["vllm_load_s"] for r in rows] == [60.0, 63.0]
    assert [r["ours_over_vllm"] for r in rows] == [0.5, 0.5] and rows[1]["rounds"] == 3


def test_prepared_prompts_are_the_sweeps(tmp_path: Path) -> None:
    from cli.common import DEFAULT_MODEL_DIR
    from mtp_core.bench.dataset import encode_request, task_requests
    from mtp_core.tokenizer import Tokenizer

    if not (DEFAULT_MODEL_DIR / "tokenizer.json").is_file():
        pytest.skip("the shipped model is not installed")
    prompts, task_ids = cv.prepare_prompts(DEFAULT_MODEL_DIR, 10, 128)
    tok = Tokenizer.from_dir(DEFAULT_MODEL_DIR)
    assert prompts == [encode_request(tok, r) for r in task_requests("all", 10, 128)]
    assert len(prompts) == 10 and len(set(task_ids)) == 10
    bos = tok.bos_token_id
    assert all(p[0] == bos and p.count(bos) == 1 for p in prompts)        # chat template: one BOS
    text = tok.decode(prompts[0], skip_special_tokens=False)
    assert "<｜User｜>" in text and "<｜Assistant｜>" in text
    # the prompts file peer_vllm reads back is the same list
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps(prompts))
    assert pv.load_prompts(f) == prompts


def test_prompt_files_json_lines_and_bad_input(tmp_path: Path) -> None:
    f = tmp_path / "p.jsonl"
    f.write_text("[1, 2, 3]\n\n[4]\n")
    assert pv.load_prompts(f) == [[1, 2, 3], [4]]
    for bad, msg in (("[]", "non-empty list"), ("[[1, -2]]", "prompt 0"), ('[[1], "x"]', "prompt 1"),
                     ("[[true]]", "prompt 0"), ("{oops", "neither")):
        f.write_text(bad)
        with pytest.raises(ValueError, match=msg):
            pv.load_prompts(f)
    with pytest.raises(ValueError, match="not found"):
        pv.load_prompts(tmp_path / "missing.json")


def test_vllm_env_matches_the_facts() -> None:
    env = pv.vllm_env(1)
    assert env["VLLM_MLA_DISABLE"] == "1" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert pv.vllm_env(2)["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and pv.vllm_env(2)["OMP_NUM_THREADS"] == "2"
    assert pv.vllm_env(1, "nobind")["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"


def test_missing_venv_is_one_line_and_exit_2(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "bin" / "python"
    with pytest.raises(ValueError, match="no vLLM venv python at"):
        cv.check_vllm_python(missing)
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "compare_vllm.py"), "--vllm_python", str(missing)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no vLLM venv python at") and "--vllm_python" in lines[0]


def test_a_python_without_vllm_fails_with_the_reason(tmp_path: Path) -> None:
    """The serve protocol end to end with our own python (no vllm here): the child reports the import
    failure as an error event and the caller raises it with the log's path instead of hanging."""
    try:
        import vllm  # noqa: F401
        pytest.skip("vllm is importable in this environment")
    except ImportError:
        pass
    (tmp_path / "config.json").write_text("{}")
    prompts = tmp_path / "p.json"
    prompts.write_text("[[1, 2, 3]]")
    with pytest.raises(RuntimeError, match="cannot import vllm") as e:
        cv.VllmPeer(Path(sys.executable), str(tmp_path), prompts, 4, 0, 1, tmp_path / "vllm.log", timeout_s=120)
    assert str(tmp_path / "vllm.log") in str(e.value)
