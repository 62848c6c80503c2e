"""The shipped model: present in the package, small, loads in transformers, and the quickstart runs on it
out of the box (no --model_dir) with MTP giving the same text as without."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import torch

from cli.common import DEFAULT_MODEL_DIR
from mtp_core.loader import load_model
from mtp_core.model import DeepseekV3ForCausalLM
from mtp_factory.data import FAMILIES

REPO = Path(__file__).resolve().parent.parent


def test_shipped_files_and_size() -> None:
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json", "MODEL_CARD.md", "loss_curves.png", "recipe.json"):
        assert (DEFAULT_MODEL_DIR / f).is_file(), f
    total = sum(f.stat().st_size for f in DEFAULT_MODEL_DIR.rglob("*") if f.is_file())
    assert total <= 40 * 2**20, f"shipped model is {total / 2**20:.1f} MiB"
    cfg = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())
    # v2 is 4 main layers (v1 had 8): the issue leaves size and shape open within the DeepSeek-V3 layout
    assert cfg["num_nextn_predict_layers"] == 3 and cfg["num_hidden_layers"] >= 4
    assert cfg["q_lora_rank"] and cfg["n_routed_experts"] >= 8 and cfg["n_group"] > 1
    assert cfg["n_shared_experts"] == 1 and cfg["first_k_dense_replace"] == 1
    for fam in FAMILIES:
        lines = (DEFAULT_MODEL_DIR / "eval" / f"eval_{fam}.jsonl").read_text().splitlines()
        rec = json.loads(lines[0])
        assert len(lines) == 50 and {"task", "question", "prompt", "answer"} <= set(rec)


def test_main_model_matches_transformers() -> None:
    from transformers import AutoModelForCausalLM
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    ours, _ = load_model(DEFAULT_MODEL_DIR, "float32", make_model=DeepseekV3ForCausalLM)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True, dtype=torch.float32)
    ids = torch.tensor([[1, 3, 40, 41, 42, 60, 4, 5]])
    with torch.no_grad():
        a = ours.compute_logits(ours.forward_dense(ids)[0])
        b = hf(ids).logits[0].float()
    assert (a - b).abs().max().item() <= 1e-4


def test_quickstart_out_of_the_box_with_mtp() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    runs = []
    for extra in ([], ["--spec_decode_algo", "MTP", "--spec_decode_max_draft_len", "3"]):
        r = subprocess.run([sys.executable, "-m", "cli", "quickstart", "--max_tokens", "48", *extra],
                           capture_output=True, text=True, env=env, cwd=REPO, timeout=600, stdin=subprocess.DEVNULL)
        assert r.returncode == 0, r.stderr
        runs.append(r)
    lines = runs[0].stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith(f"[{i}] Prompt: ") for i, line in enumerate(lines))
    assert runs[1].stdout == runs[0].stdout
    assert "acceptance length (AL)" in runs[1].stderr


def test_quickstart_default_lets_the_shipped_model_finish_its_answers() -> None:
    """No --model_dir and no --max_tokens: enough tokens for the reasoning to close and the answer to come."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "cli", "quickstart", "--prompt", "What is 347 + 285?",
                        "--spec_decode_algo", "MTP", "--spec_decode_max_draft_len", "3"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=600, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    assert "</think>" in r.stdout and "The answer is" in r.stdout, r.stdout


def _expected_default_answers() -> dict[str, str]:
    """The reference answer of each default quickstart prompt, computed here from the numbers/word in it."""
    import re

    from cli.quickstart import DEFAULT_PROMPTS

    out = {}
    for p in DEFAULT_PROMPTS:
        nums = [int(x) for x in re.findall(r"\d+", p)]
        if " + " in p or "sum of" in p or " plus " in p or p.startswith("Add "):
            out[p] = str(nums[0] + nums[1])
        elif "biggest" in p or "largest number" in p or "maximum" in p:
            out[p] = str(max(nums))
        elif "order" in p:
            out[p] = ", ".join(map(str, sorted(nums, reverse="decreasing" in p or "descending" in p)))
        elif "occur" in p or "how many" in p.lower():
            word, letter = re.search(r'"([a-z]+)"', p).group(1), re.search(r"'([a-z])'", p).group(1)
            out[p] = str(word.count(letter))
        elif "backwards" in p or "Reverse" in p:
            out[p] = re.search(r'"([a-z]+)"', p).group(1)[::-1]
        elif " - " in p:
            out[p] = str(nums[0] - nums[1])
        elif "×" in p or " * " in p:
            out[p] = str(nums[0] * nums[1])
        else:
            raise AssertionError(f"no reference rule for default prompt {p!r}")
    return out


def test_quickstart_default_prompts_are_answered_correctly_with_mtp() -> None:
    """The issue's bar: a fresh clone's quickstart (no --model_dir, no --max_tokens) with MTP K=3 prints
    the right answer to each of its three default prompts."""
    import ast

    from mtp_core.bench.scoring import extract_answer

    expected = _expected_default_answers()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "cli", "quickstart", "--spec_decode_algo", "MTP",
                        "--spec_decode_max_draft_len", "3"],
                       capture_output=True, text=True, env=env, cwd=REPO, timeout=600, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == len(expected) == 3
    for line, (prompt, answer) in zip(lines, expected.items()):
        head, text = line.split(", Generated text: ", 1)
        assert ast.literal_eval(head.split("Prompt: ", 1)[1]) == prompt
        assert extract_answer(ast.literal_eval(text)) == answer, (prompt, text)


def test_shipped_recipe_is_the_tiny_r1_recipe() -> None:
    """`mtp train --recipe tiny-r1` trains what ships: the asset's recipe.json is that recipe, setting for setting."""
    from mtp_factory.recipes import RECIPES

    shipped = json.loads((DEFAULT_MODEL_DIR / "recipe.json").read_text())
    assert shipped == json.loads(json.dumps(RECIPES["tiny-r1"].to_dict()))
