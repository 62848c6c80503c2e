"""`mtp quickstart` through the real CLI in a subprocess: bad input, security, Ctrl-C, pipes, terminals.

Every bad input must give its exit code, exactly one `error:` line on stderr naming the thing, an empty
stdout and no traceback. (Cases already covered by tests/test_cli.py are not repeated here: empty prompt,
prompt over max_seq_len, max_tokens 0, unknown algorithm, Vanilla K above the modules, FP8 KV on CPU.)
"""
from __future__ import annotations

import json
import os
import pickle
import pty
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

import pytest

from mtp_core.tiny import make_tiny_checkpoint

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "COLUMNS": "200"}
LINE = re.compile(r"^\[(\d+)\] Prompt: (.*), Generated text: (.*)$")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """2 main layers, 2 MTP modules; seed 5 generates 500 tokens for the prompt 'a' without an EOS."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("errors") / "tiny", num_mtp=2, num_layers=2, seed=5)


def mtp(*args: str, stdin: str | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli", *args], input=stdin, capture_output=True, text=True,
                          env=ENV, cwd=cwd, timeout=300, stdin=None if stdin is not None else subprocess.DEVNULL)


def assert_error(r: subprocess.CompletedProcess, code: int, *needles: str) -> str:
    assert r.returncode == code, (r.returncode, r.stderr)
    assert r.stdout == ""
    assert "Traceback" not in r.stderr and "Exception ignored" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    for needle in needles:
        assert needle in errors[0], (needle, errors[0])
    return errors[0]


def copy_of(ckpt: Path, dest: Path) -> Path:
    shutil.copytree(ckpt, dest)
    return dest


def edit_json(path: Path, change: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def index_to(d: Path, shard: str) -> None:
    """Replace model.safetensors by an index that maps every tensor to `shard`."""
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard for n in names}}))


# ---- checkpoint directories -------------------------------------------------------------------

def _missing_dir(c: Path, t: Path) -> tuple[Path, tuple[str, ...]]:
    return t / "nowhere", ("does not exist", "nowhere")


def _no_config(c: Path, t: Path) -> tuple[Path, tuple[str, ...]]:
    d = copy_of(c, t / "m")
    (d / "config.json").unlink()
    return d, ("config.json",)


def _missing_shard(c: Path, t: Path) -> tuple[Path, tuple[str, ...]]:
    d = copy_of(c, t / "m")
    index_to(d, "model-00002-of-00002.safetensors")
    return d, ("model-00002-of-00002.safetensors", "missing")


def _lfs_pointer(c: Path, t: Path) -> tuple[Path, tuple[str, ...]]:
    d = copy_of(c, t / "m")
    (d / "model.safetensors").write_text("version https://git-lfs.github.com/spec/v1\n"
                                         "oid sha256:4d7a214614ab2935c943f9e0ff69d22eadbb8f32b1258daaa5e2ca24d17e2393\n"
                                         "size 1369496\n")
    return d, ("model.safetensors", "Git LFS", "git lfs pull")


def _truncated(c: Path, t: Path) -> tuple[Path, tuple[str, ...]]:
    d = copy_of(c, t / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    return d, ("model.safetensors", "truncated")


def _escape_dotdot(c: Path, t: Path) -> tuple[Path, tuple[str, ...]]:
    d = copy_of(c, t / "m")
    shutil.copy(d / "model.safetensors", t / "outside.safetensors")
    index_to(d, "../outside.safetensors")
    return d, ("../outside.safetensors", "outside the model directory")


def _escape_absolute(c: Path, t: Path) -> tuple[Path, tuple[str, ...]]:
    d = copy_of(c, t / "m")
    shutil.copy(d / "model.safetensors", t / "outside.safetensors")
    index_to(d, str(t / "outside.safetensors"))
    return d, ("outside.safetensors", "absolute")


def _escape_symlink(c: Path, t: Path) -> tuple[Path, tuple[str, ...]]:
    d = copy_of(c, t / "m")
    (d / "model.safetensors").rename(t / "outside.safetensors")
    (d / "model.safetensors").symlink_to(t / "outside.safetensors")
    return d, ("model.safetensors", "outside the model directory")


def _config_missing_field(c: Path, t: Path) -> tuple[Path, tuple[str, ...]]:
    d = copy_of(c, t / "m")
    edit_json(d / "config.json", lambda cfg: cfg.pop("kv_lora_rank"))
    return d, ("config.json", "missing", "kv_lora_rank")


def _config_contradiction(c: Path, t: Path) -> tuple[Path, tuple[str, ...]]:
    d = copy_of(c, t / "m")
    edit_json(d / "config.json", lambda cfg: cfg.update(num_experts_per_tok=9))   # 8 routed experts
    return d, ("config.json", "num_experts_per_tok=9", "n_routed_experts=8")


@pytest.mark.parametrize("make", [_missing_dir, _no_config, _missing_shard, _lfs_pointer, _truncated,
                                  _escape_dotdot, _escape_absolute, _escape_symlink, _config_missing_field,
                                  _config_contradiction], ids=lambda f: f.__name__[1:])
def test_bad_checkpoint(ckpt: Path, tmp_path: Path, make) -> None:
    model_dir, needles = make(ckpt, tmp_path)
    assert_error(mtp("quickstart", "--model_dir", str(model_dir), "--prompt", "hi", "--max_tokens", "2"), 2, *needles)


# ---- flags, prompts, YAML -------------------------------------------------------------------------

def test_relaxed_acceptance_needs_think_tokens(ckpt: Path, tmp_path: Path) -> None:
    d = copy_of(ckpt, tmp_path / "nothink")
    text = (d / "tokenizer.json").read_text(encoding="utf-8")
    assert "<think>" in text and "</think>" in text
    (d / "tokenizer.json").write_text(text.replace("think>", "thonk>"), encoding="utf-8")
    r = mtp("quickstart", "--model_dir", str(d), "--prompt", "hi", "--max_tokens", "2", "--spec_decode_algo", "MTP",
            "--use_relaxed_acceptance_for_thinking", "--relaxed_topk", "10", "--relaxed_delta", "0.6")
    assert_error(r, 2, "<think>", "--use_relaxed_acceptance_for_thinking")


@pytest.mark.parametrize("yaml_text, needles", [
    ("kv_cache_config: {max_tokens: 8, tokens_per_block: 4}\n", ("KV cache pool holds 8",)),
    ("- speculative_config\n- kv_cache_config\n", ("cfg.yml", "mapping", "list")),
    ("speculative_config:\n  num_nextn_predict_layer: 2\n", ("num_nextn_predict_layer", "did you mean")),
    ("kv_cache_config:\n  free_gpu_memory_fraction: 1.5\n", ("free_gpu_memory_fraction", "(0, 1]", "1.5")),
], ids=["kv_pool_too_small", "not_mapping", "unknown_key", "out_of_range"])
def test_bad_yaml(ckpt: Path, tmp_path: Path, yaml_text: str, needles: tuple[str, ...]) -> None:
    (tmp_path / "cfg.yml").write_text(yaml_text)
    r = mtp("quickstart", "--model_dir", str(ckpt), "--prompt", "a prompt longer than eight tokens", "--max_tokens",
            "2", "--config", str(tmp_path / "cfg.yml"))
    assert_error(r, 2, *needles)


@pytest.mark.parametrize("args, needles", [
    (["--bogus_flag"], ("No such option: --bogus_flag", "mtp quickstart --help")),
    (["--max_tokens", "many"], ("--max_tokens",)),
    (["--mtp_mode", "sideways"], ("--mtp_mode", "sideways")),
    (["--max_tokens", "-3"], ("--max_tokens must be >= 1, got -3",)),
    (["--prompt", "-"], ("stdin",)),                         # stdin holds only blank lines
    (["--spec_decode_algo", "MTP", "--use_mtp_vanilla", "--mtp_mode", "eagle"],
     ("--use_mtp_vanilla contradicts --mtp_mode eagle",)),   # worded in flags, as the YAML rule is in keys
], ids=["unknown_flag", "bad_int", "bad_choice", "negative_max_tokens", "blank_stdin", "vanilla_vs_eagle"])
def test_bad_flags(ckpt: Path, args: list[str], needles: tuple[str, ...]) -> None:
    prompt = [] if "--prompt" in args else ["--prompt", "hi"]
    assert_error(mtp("quickstart", "--model_dir", str(ckpt), *prompt, *args, stdin="\n  \n"), 2, *needles)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU fallbacks")
def test_gpu_flags_accepted_on_cpu(ckpt: Path) -> None:
    r = mtp("quickstart", "--model_dir", str(ckpt), "--prompt", "hi", "--max_tokens", "4", "--use_cuda_graph",
            "--cuda_graph_batch_sizes", "1", "--cuda_graph_batch_sizes", "4", "--cuda_graph_padding_enabled",
            "--moe_backend", "cutlass", "--disable_kv_cache_reuse", "--moe_ep_size", "-1", "--num_threads", "1")
    assert r.returncode == 0, r.stderr
    assert LINE.match(r.stdout) and len(r.stdout.splitlines()) == 1
    warnings = [line for line in r.stderr.splitlines() if line.startswith("[WARNING]")]
    assert len(warnings) == 2 and "Traceback" not in r.stderr, r.stderr
    assert "CUDA graphs need an NVIDIA GPU" in warnings[0] and "running eagerly" in warnings[0]
    assert "MoE backend CUTLASS needs an NVIDIA GPU" in warnings[1] and "PyTorch MoE" in warnings[1]


# ---- security ----------------------------------------------------------------------------------

class _Trap:
    """Unpickling this runs code: it writes the marker file (a pickle loader would fall for it)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (exec, (f"open({str(self.marker)!r}, 'w').write('unpickled')",))


def _plant_traps(d: Path, marker: Path) -> None:
    code = f"open({str(marker)!r}, 'w').write('imported')\n"
    for name in ("modeling_evil.py", "configuration_evil.py", "tokenization_evil.py", "__init__.py"):
        (d / name).write_text(code)
    edit_json(d / "config.json", lambda c: c.update(auto_map={
        "AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.EvilModel"}))
    edit_json(d / "tokenizer_config.json",
              lambda c: c.update(auto_map={"AutoTokenizer": ["tokenization_evil.T", None]}))
    (d / "pytorch_model.bin").write_bytes(pickle.dumps(_Trap(marker)))


def test_no_code_or_pickle_from_the_model_directory(ckpt: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    d = copy_of(ckpt, tmp_path / "evil")
    _plant_traps(d, marker)
    r = mtp("quickstart", "--model_dir", str(d), "--prompt", "hi", "--max_tokens", "3", "--trust_remote_code", cwd=d)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 1 and LINE.match(r.stdout.splitlines()[0])
    assert "--trust_remote_code is ignored" in r.stderr
    assert not marker.exists()
    (d / "model.safetensors").unlink()          # only the pickle is left: refused, never opened
    assert_error(mtp("quickstart", "--model_dir", str(d), "--prompt", "hi", cwd=d), 2, "safetensors")
    assert not marker.exists()


# ---- Ctrl-C, pipes, terminals ------------------------------------------------------------------

def test_ctrl_c_prints_finished_results_then_exits_130(ckpt: Path) -> None:
    n = 40
    proc = subprocess.Popen([sys.executable, "-m", "cli", "quickstart", "--model_dir", str(ckpt), "--prompt",
                             *["a"] * n, "--max_tokens", "150", "--max_batch_size", "1", "--print_iter_log",
                             "--spec_decode_algo", "MTP", "--spec_decode_max_draft_len", "2"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=ENV, cwd=REPO,
                            # a runner started in the background (nohup, `&`) passes SIGINT on as ignored,
                            # and Python then never installs its Ctrl-C handler: give the child the default
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    prefills = 0
    try:
        for line in proc.stderr:                 # batch 1: a new prefill means the previous request finished
            prefills += "(1 prefill)" in line
            if prefills == 3:
                proc.send_signal(signal.SIGINT)
                break
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert prefills == 3
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted:" in err
    rows = [LINE.match(line) for line in out.splitlines()]
    assert all(rows) and 2 <= len(rows) < n, out
    assert [int(m.group(1)) for m in rows] == list(range(len(rows)))   # in prompt order, none skipped
    texts = {m.group(3) for m in rows}
    assert len(texts) == 1 and len(eval(texts.pop())) > 100              # noqa: S307 - full, identical outputs


def test_stdout_closed_early_is_quiet(ckpt: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "cli", "quickstart", "--model_dir", str(ckpt), "--prompt", "a",
                             "b", "--max_tokens", "2"], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=REPO)
    proc.stdout.close()                          # like `| head -0`: the reader is gone before any line
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141, err
    assert err == ""                             # no traceback; and stderr is a pipe, so no progress bars


def test_progress_only_on_a_terminal(ckpt: Path) -> None:
    args = [sys.executable, "-m", "cli", "quickstart", "--model_dir", str(ckpt), "--prompt", "a", "b",
            "--max_tokens", "3"]
    master, slave = pty.openpty()
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env={
        **ENV, "TERM": "xterm"}, cwd=REPO)
    os.close(slave)
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:                      # EIO: the child closed the terminal
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain)
    reader.start()
    out = proc.stdout.read().decode()
    assert proc.wait(timeout=120) == 0
    reader.join(timeout=30)
    os.close(master)
    tty_err = b"".join(chunks).decode(errors="replace")
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        num_tensors = len(list(f.keys()))
    assert "loading weights" in tty_err and f"{num_tensors}/{num_tensors}" in tty_err
    assert "generating" in tty_err and "2/2" in tty_err
    assert [int(LINE.match(line).group(1)) for line in out.splitlines()] == [0, 1]   # stdout: results only
    # (stderr not a terminal -> no bars: test_stdout_closed_early_is_quiet sees an empty stderr)
