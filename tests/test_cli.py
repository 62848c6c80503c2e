"""The real CLI in a subprocess: output lines, MTP equality, stdin, YAML, exit codes."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_core.tiny import make_tiny_checkpoint

REPO = Path(__file__).resolve().parent.parent
LINE = re.compile(r"^\[(\d+)\] Prompt: (.*), Generated text: (.*)$")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("cli") / "tiny", num_mtp=3, num_layers=2, seed=3)


def mtp(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "cli", *args], input=stdin, capture_output=True, text=True,
                          env=env, cwd=REPO, timeout=300)


def result_lines(out: str) -> list[tuple[int, str, str]]:
    rows = []
    for line in out.splitlines():
        m = LINE.match(line)
        assert m, f"unexpected stdout line: {line!r}"
        rows.append((int(m.group(1)), eval(m.group(2)), eval(m.group(3))))  # noqa: S307 - repr of str
    return rows


def test_quickstart_lines_and_mtp_equality(ckpt: Path) -> None:
    base = mtp("quickstart", "--model_dir", str(ckpt), "--prompt", "Hello there", "12+7=", "--max_tokens", "12")
    assert base.returncode == 0, base.stderr
    rows = result_lines(base.stdout)
    assert [(i, p) for i, p, _ in rows] == [(0, "Hello there"), (1, "12+7=")]
    for extra in (["--spec_decode_nextn", "3", "--mtp_mode", "eagle"], ["--spec_decode_max_draft_len", "2"]):
        spec = mtp("quickstart", "--model_dir", str(ckpt), "--prompt", "Hello there", "12+7=", "--max_tokens", "12",
                   "--spec_decode_algo", "MTP", *extra)
        assert spec.returncode == 0, spec.stderr
        assert spec.stdout == base.stdout
        assert "acceptance length (AL)" in spec.stderr


def test_stdin_pipeline_and_example_wrapper(ckpt: Path) -> None:
    piped = mtp("quickstart", "--model_dir", str(ckpt), "--max_tokens", "4", stdin="first\n\nsecond\n")
    assert piped.returncode == 0, piped.stderr
    assert [p for _, p, _ in result_lines(piped.stdout)] == ["first", "second"]
    dash = mtp("quickstart", "--model_dir", str(ckpt), "--max_tokens", "4", "--prompt", "-", stdin="first\n")
    assert [p for _, p, _ in result_lines(dash.stdout)] == ["first"]
    wrapper = subprocess.run([sys.executable, "examples/quickstart_advanced.py", "--model_dir", str(ckpt),
                              "--prompt", "first", "--max_tokens", "4"], capture_output=True, text=True, cwd=REPO,
                             env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300)
    assert wrapper.returncode == 0, wrapper.stderr
    assert wrapper.stdout.splitlines()[0] == piped.stdout.splitlines()[0]


def test_repo_yaml_example_runs(ckpt: Path) -> None:
    r = mtp("quickstart", "--model_dir", str(ckpt), "--prompt", "Hi", "--max_tokens", "6",
            "--extra_llm_api_options", str(REPO / "extra-llm-api-config.yml"), "--spec_decode_algo", "MTP")
    assert r.returncode == 0, r.stderr
    assert len(result_lines(r.stdout)) == 1


def test_fp8_kv_cache_runs_on_the_cpu(ckpt: Path) -> None:
    """--kv_cache_dtype fp8 (e4m3 latents) is no longer refused on a CPU: the native forward reads it."""
    r = mtp("quickstart", "--model_dir", str(ckpt), "--prompt", "Hi", "--max_tokens", "6", "--kv_cache_dtype", "fp8",
            "--spec_decode_algo", "MTP", "--spec_decode_max_draft_len", "2", "--log_level", "info")
    assert r.returncode == 0, r.stderr
    assert len(result_lines(r.stdout)) == 1 and "Traceback" not in r.stderr


@pytest.mark.parametrize("args, code, needle", [
    (["--max_tokens", "0"], 2, "max_tokens"),
    (["--spec_decode_algo", "EAGLE3"], 2, "spec_decode_algo"),
    (["--spec_decode_algo", "MTP", "--mtp_mode", "vanilla", "--spec_decode_nextn", "4"], 2, "3 MTP module"),
    (["--prompt", ""], 2, "empty"),
    (["--max_seq_len", "4", "--prompt", "a long prompt that has many tokens in it"], 2, "max_seq_len"),
])
def test_bad_input_one_line_error(ckpt: Path, args: list[str], code: int, needle: str) -> None:
    r = mtp("quickstart", "--model_dir", str(ckpt), *(["--prompt", "hi"] if "--prompt" not in args else []), *args)
    assert r.returncode == code, (r.returncode, r.stderr)
    assert r.stdout == ""
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and needle in err[0], r.stderr
    assert "Traceback" not in r.stderr


def test_bad_model_dir(tmp_path: Path, ckpt: Path) -> None:
    r = mtp("quickstart", "--model_dir", str(tmp_path / "nope"), "--prompt", "hi")
    assert r.returncode == 2 and "does not exist" in r.stderr
    (tmp_path / "cfg").mkdir()
    r = mtp("quickstart", "--model_dir", str(tmp_path / "cfg"), "--prompt", "hi")
    assert r.returncode == 2 and "config.json" in r.stderr
    bad = tmp_path / "shape"
    bad.mkdir()
    for f in ckpt.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((bad / "config.json").read_text())
    cfg["kv_lora_rank"] = 48
    (bad / "config.json").write_text(json.dumps(cfg))
    r = mtp("quickstart", "--model_dir", str(bad), "--prompt", "hi")
    assert r.returncode == 2 and "expected" in r.stderr and "Traceback" not in r.stderr


def test_make_tiny_refuses_nonempty(tmp_path: Path) -> None:
    (tmp_path / "x").write_text("keep me")
    r = mtp("make-tiny", str(tmp_path))
    assert r.returncode == 2 and "not empty" in r.stderr
    assert (tmp_path / "x").read_text() == "keep me"


def test_flag_lists_come_from_the_schema() -> None:
    """Every engine flag of the schema reaches quickstart and serve, the whole speculative section reaches bench,
    and each key is listed once (the lists are derived: cli/options.py help_order and section_keys)."""
    import inspect

    from cli.bench import FLAGS as BENCH_FLAGS
    from cli.options import help_order, section_keys
    from cli.quickstart import FLAGS, REQUEST_FLAGS
    from cli.serve import serve_command
    from mtp_core.config.flags import engine_flags, section_flags

    assert set(engine_flags()) | set(REQUEST_FLAGS) <= set(FLAGS) and len(FLAGS) == len(set(FLAGS))
    assert set(engine_flags()) <= set(inspect.signature(serve_command).parameters)
    spec = section_keys("speculative_config")
    assert spec[0] == "spec_decode_algo" and set(spec[1:]) == set(section_flags("speculative_config"))
    assert set(spec) <= set(BENCH_FLAGS) and len(BENCH_FLAGS) == len(set(BENCH_FLAGS))
    # runs filed after a key, a run's own keys may carry runs too; the rest keeps its order
    assert help_order({"b": ("x", "y"), "x": ("z",)}, ("a", "b", "c", "y")) == ("a", "b", "x", "z", "y", "c")
