"""`mtp train-mtp`: self-distillation fine-tuning of MTP modules on tiny checkpoints.

Main tensors bitwise unchanged, greedy output with the new modules == greedy output without MTP, resume
after an interruption gives the same weights as an uninterrupted run, --add_mtp writes a checkpoint that
loads here and in transformers, and each bad input is refused with one line and nothing written.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mtp_core.loader import load_model
from mtp_core.llm import LLM
from mtp_core.model import DeepseekV3ForCausalLM
from mtp_core.sampling import SamplingParams
from mtp_core.tiny import make_tiny_checkpoint
from mtp_core import train_mtp as ft
from mtp_core.train_mtp import FinetuneOptions, run

from conftest import PROMPTS, llm_config

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "COLUMNS": "200"}
TEXTS = ["the cat sat on the mat", "a dog ran to the big red house", "one two three four five six",
         "hello world, this is a test", "numbers: 1 2 3 4 5 6 7 8 9", "red green blue red green blue",
         "the quick brown fox jumps", "lorem ipsum dolor sit amet", "x y z x y z x y z", "to be or not to be"]


def _prompts(path: Path) -> Path:
    path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in TEXTS), encoding="utf-8")
    return path


def _opts(src: Path, out: Path, prompts: Path, **kw) -> FinetuneOptions:
    base = dict(model_dir=src, out=out, prompts=prompts, max_steps=6, gen_tokens=12, eval_tokens=12, eval_k=2,
                seq_len=24, batch_size=3, gen_batch=4, save_every=2, log_every=2, num_threads=1, lr=2e-3,
                chat_template=False, heldout=0.2)
    base.update(kw)
    return FinetuneOptions(**base)


def _tensors(d: Path) -> dict[str, tuple[str, bytes]]:
    """name -> (dtype, raw bytes) of every tensor the checkpoint's index / files name."""
    from mtp_core.loader.checkpoint import open_checkpoint
    ck = open_checkpoint(d)
    out = {}
    for name, f in ck.shards.items():
        with safe_open(str(f), framework="pt") as h:
            t = h.get_tensor(name)
        out[name] = (str(t.dtype), t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return out


def _is_main(name: str, L: int) -> bool:
    parts = name.split(".")
    return not (parts[:2] == ["model", "layers"] and int(parts[2]) >= L)


@pytest.fixture(scope="module")
def finetuned(tiny3_dir, tmp_path_factory):
    """tiny3 (3 main layers + 3 sharpened MTP modules), fine-tuned in Eagle + Vanilla mode."""
    tmp = tmp_path_factory.mktemp("train_mtp")
    out = tmp / "dst"
    report = run(_opts(tiny3_dir, out, _prompts(tmp / "p.jsonl")), echo=lambda s: None)
    return tiny3_dir, out, report


def test_main_tensors_bitwise_equal_and_mtp_changed(finetuned):
    src, dst, report = finetuned
    a, b = _tensors(src), _tensors(dst)
    main = [n for n in a if _is_main(n, 3)]
    assert main and all(b[n] == a[n] for n in main), "a main tensor changed"
    assert set(n for n in b if _is_main(n, 3)) == set(main)
    mtp = [n for n in a if not _is_main(n, 3)]
    assert any(b[n] != a[n] for n in mtp), "training changed no MTP tensor"
    idx = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert {idx[n] for n in mtp} == {"model-mtp.safetensors"}
    assert {idx[n] for n in main} == {"model-main.safetensors"}
    # DeepSeek-V3 layout: each MTP layer carries copies of the embedding and the head
    assert idx["model.layers.3.embed_tokens.weight"] == "model-mtp.safetensors"
    assert (dst / "tokenizer.json").read_bytes() == (src / "tokenizer.json").read_bytes()
    assert json.loads((dst / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    rep = json.loads((dst / ft.REPORT).read_text())
    assert set(rep["before"]) == set(rep["after"]) == {"eagle K=2", "vanilla K=2"}
    assert rep["trained_modules"] == [1, 2, 3]
    assert not (dst.parent / "dst.train-mtp-work").exists(), "work dir left behind without --keep_work"


@pytest.mark.parametrize("mode,K", [("eagle", 1), ("eagle", 3), ("vanilla", 3)])
def test_greedy_with_new_mtp_equals_greedy_without(finetuned, mode, K):
    _, dst, _ = finetuned
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = LLM(llm_config(dst, max_batch_size=8)).generate(PROMPTS, params)
    spec = LLM(llm_config(dst, nextn=K, mode=mode, max_batch_size=8)).generate(PROMPTS, params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in ref]
    assert sum(r.stats.num_draft_accepted for r in spec) > 0, "no draft accepted: the test would prove nothing"


def test_resume_after_interruption_matches_uninterrupted(tiny1_dir, tmp_path, monkeypatch):
    prompts = _prompts(tmp_path / "p.jsonl")
    full = tmp_path / "full"
    run(_opts(tiny1_dir, full, prompts, mtp_mode="eagle"), echo=lambda s: None)

    work, out = tmp_path / "work", tmp_path / "resumed"
    calls = {"gen": 0, "steps": 0}
    real_cont, real_batch = ft.Generator.continuations, ft.make_batch

    def cont_then_die(self, prompts, first):
        calls["gen"] += 1
        if calls["gen"] == 2:
            raise KeyboardInterrupt
        return real_cont(self, prompts, first)

    monkeypatch.setattr(ft.Generator, "continuations", cont_then_die)
    with pytest.raises(KeyboardInterrupt):             # dies while generating chunk 2
        run(_opts(tiny1_dir, out, prompts, mtp_mode="eagle", work_dir=work), echo=lambda s: None)
    assert (work / "cache" / "chunk-00000.safetensors").is_file() and not out.exists()
    assert not list(tmp_path.glob(".resumed.*")), "a partial output directory was left behind"

    def batch_then_die(cache, step, o):
        if step == 3:
            raise KeyboardInterrupt
        return real_batch(cache, step, o)

    monkeypatch.setattr(ft.Generator, "continuations", real_cont)
    monkeypatch.setattr(ft, "make_batch", batch_then_die)
    log: list[str] = []
    with pytest.raises(KeyboardInterrupt):             # dies at step 3 (state saved at step 2)
        run(_opts(tiny1_dir, out, prompts, mtp_mode="eagle", work_dir=work), echo=log.append)
    assert sum("self-distillation data: chunk 1/" in s for s in log) == 0, "chunk 1 was generated again"
    assert json.loads((work / "state" / "state.json").read_text())["step"] == 2

    monkeypatch.setattr(ft, "make_batch", real_batch)
    log.clear()
    run(_opts(tiny1_dir, out, prompts, mtp_mode="eagle", work_dir=work), echo=log.append)
    assert any("resuming MTP training from step 2" in s for s in log)
    assert _tensors(out) == _tensors(full), "the resumed run differs from the uninterrupted one"


def test_add_mtp_loads_here_and_in_transformers(tmp_path):
    src = make_tiny_checkpoint(tmp_path / "nomtp", seed=3, num_layers=2, num_mtp=0, num_shards=2)
    dst = tmp_path / "added"
    run(_opts(src, dst, _prompts(tmp_path / "p.jsonl"), add_mtp=2, mtp_mode="both"), echo=lambda s: None)
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 2 and cfg["num_hidden_layers"] == 2
    idx = json.loads((dst / "model.safetensors.index.json").read_text())["weight_map"]
    assert {n.split(".")[2] for n in idx if idx[n] == "model-mtp.safetensors"} == {"2", "3"}
    for f in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):   # untouched shards
        assert (dst / f).read_bytes() == (src / f).read_bytes()
    model, _ = load_model(dst, "float32", make_model=DeepseekV3ForCausalLM)
    assert model.num_mtp_modules == 2
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ref = LLM(llm_config(dst)).generate(PROMPTS[:4], params)
    spec = LLM(llm_config(dst, nextn=2, mode="vanilla")).generate(PROMPTS[:4], params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in ref]

    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(dst, torch_dtype=torch.float32, local_files_only=True)
    assert type(hf).__name__ == "DeepseekV3ForCausalLM"
    ids = torch.tensor([[1, 50, 60, 70, 80, 90]])
    with torch.no_grad():
        theirs = hf(ids).logits[0]
        ours = model.compute_logits(model.forward_dense(ids))[0]
    assert torch.allclose(theirs, ours, atol=1e-4), (theirs - ours).abs().max()


def test_fp8_source_keeps_quantized_main_tensors(tiny1_dir, tmp_path):
    from mtp_core.quantize import quantize_checkpoint
    q = tmp_path / "fp8"
    quantize_checkpoint(tiny1_dir, q, "fp8")
    dst = tmp_path / "dst"
    run(_opts(q, dst, _prompts(tmp_path / "p.jsonl"), mtp_mode="eagle", max_steps=2), echo=lambda s: None)
    a, b = _tensors(q), _tensors(dst)
    main = [n for n in a if _is_main(n, 2)]
    assert any(a[n][0] == "torch.float8_e4m3fn" for n in main)
    assert all(b[n] == a[n] for n in main)
    mtp_dtypes = {b[n][0] for n in b if not _is_main(n, 2)}
    assert "torch.float8_e4m3fn" not in mtp_dtypes and "torch.bfloat16" in mtp_dtypes
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ref = LLM(llm_config(dst)).generate(PROMPTS[:4], params)
    spec = LLM(llm_config(dst, nextn=2, mode="eagle")).generate(PROMPTS[:4], params)
    assert [r.token_ids for r in spec] == [r.token_ids for r in ref]


# ---- bad input: one line, exit 2, nothing written ----------------------------------------------------------

def _cli(*args: str, cwd: Path):
    """In-process through the real app (no interpreter start-up per case)."""
    from typer.testing import CliRunner
    from cli.app import app
    return CliRunner().invoke(app, ["train-mtp", *args], catch_exceptions=False)


def _refused(r, needle: str, tmp: Path, before: set) -> None:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.exit_code == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert set(tmp.rglob("*")) == before, "something was written"


def test_bad_inputs_refused(tiny1_dir, tmp_path):
    nomtp = make_tiny_checkpoint(tmp_path / "nomtp", seed=2, num_layers=2, num_mtp=0)
    good = _prompts(tmp_path / "p.jsonl")
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    bad_utf8 = tmp_path / "bin.txt"
    bad_utf8.write_bytes(b"\xff\xfe\x00bad")
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("keep me")
    cases = [
        ((str(nomtp), str(tmp_path / "o1"), str(good)), (), "has no MTP modules"),
        ((str(tiny1_dir), str(tmp_path / "o2"), str(good)), ("--add_mtp", "1"), "already has 1"),
        ((str(tiny1_dir), str(tmp_path / "o3"), str(empty)), (), "holds no prompt"),
        ((str(tiny1_dir), str(tmp_path / "o4"), str(tmp_path / "missing.txt")), (), "not found"),
        ((str(tiny1_dir), str(tmp_path / "o5"), str(bad_utf8)), (), "cannot read prompt file"),
        ((str(tiny1_dir), str(tiny1_dir / "sub"), str(good)), (), "inside the source checkpoint"),
        ((str(tiny1_dir), str(full), str(good)), (), "not empty"),
    ]
    src_before = set(tiny1_dir.rglob("*"))
    for (src, out, prompts), extra, needle in cases:
        before = set(tmp_path.rglob("*"))
        r = _cli("--model_dir", src, "--out", out, "--prompts", prompts, "--num_threads", "1", *extra, cwd=tmp_path)
        _refused(r, needle, tmp_path, before)
    assert set(tiny1_dir.rglob("*")) == src_before
    assert (full / "x").read_text() == "keep me"
    # and once through a real process: exit status 2 and the one line
    r = subprocess.run([sys.executable, "-m", "cli", "train-mtp", "--model_dir", str(nomtp), "--out",
                        str(tmp_path / "o9"), "--prompts", str(good)], capture_output=True, text=True, env=ENV,
                       cwd=REPO, timeout=300, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "has no MTP modules" in r.stderr, r.stderr
    assert not (tmp_path / "o9").exists()


def test_not_enough_disk_refused(tiny1_dir, tmp_path, monkeypatch):
    class Usage:
        free = 1 << 20
    monkeypatch.setattr(ft.shutil, "disk_usage", lambda p: Usage())
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="not enough disk for the self-distillation cache"):
        run(_opts(tiny1_dir, out, _prompts(tmp_path / "p.jsonl")), echo=lambda s: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl"]
