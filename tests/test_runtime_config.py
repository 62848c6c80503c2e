"""The config's `runtime` section and its environment overrides (mtp_core/config/runtime.py).

The YAML key picks the native CPU kernels' instruction set (the native forward's log line says which ran), the
environment variable overrides the key, a bad value is one `error:` line and exit 2, the getters resolve the
config value under the environment's, and no file but config/runtime.py reads an MTP_CORE_* variable.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mtp_core import kernels
from mtp_core.config import LLMConfig, RuntimeConfig, runtime
from mtp_core.config.schema import ConfigError
from mtp_core.tiny import make_tiny_checkpoint
from mtp_core.yaml_config import apply_yaml_options

REPO = Path(__file__).resolve().parent.parent
BASE_ENV = {k: v for k, v in os.environ.items() if not k.startswith("MTP_CORE_")}
ISA_LINE = re.compile(r"native CPU decode forward on \((\w+) kernels")
needs_native = pytest.mark.skipif(not kernels.native_ops().cpu, reason=kernels.native_ops().summary)


def cpu_has(flag: str) -> bool:
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return re.search(rf"\b{flag}\b", cpu) is not None


def table_for(cap: str) -> str:
    """The kernel table a cap gives on this CPU (decode_cpu.cpp: pick_table)."""
    if cap in ("auto", "amx", "avx512", "avx512f") and cpu_has("avx512f"):
        return "avx512"
    return "avx2" if cap != "generic" and cpu_has("avx2") else "generic"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("runtime") / "tiny", num_mtp=1, num_layers=2, seed=3)


def quickstart(ckpt: Path, yaml_text: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    cfg = tmp_path / "extra.yml"
    cfg.write_text(yaml_text)
    return subprocess.run([sys.executable, "-m", "cli", "quickstart", "--model_dir", str(ckpt), "--prompt", "a",
                           "--max_tokens", "2", "--log_level", "info", "--config", str(cfg)],
                          capture_output=True, text=True, cwd=REPO, timeout=300,
                          env={**BASE_ENV, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **env})


def ran_isa(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, r.stderr[-2000:]
    found = ISA_LINE.findall(r.stderr)
    assert found, r.stderr[-2000:]
    return found[-1]


def one_error(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    return errors[0]


# ---- the YAML key, the environment override, bad values (the real CLI) ---------------------------
@needs_native
def test_yaml_key_selects_the_isa_and_the_env_var_overrides_it(ckpt, tmp_path) -> None:
    assert ran_isa(quickstart(ckpt, "runtime:\n  cpu_isa: generic\n", tmp_path)) == "generic"
    assert ran_isa(quickstart(ckpt, "runtime:\n  cpu_isa: avx2\n", tmp_path)) == table_for("avx2")
    assert ran_isa(quickstart(ckpt, "runtime:\n  cpu_isa: generic\n", tmp_path,
                              MTP_CORE_CPU_ISA="avx2")) == table_for("avx2")
    assert ran_isa(quickstart(ckpt, "runtime: {}\n", tmp_path)) == table_for("auto")


@needs_native
def test_yaml_native_decode_off_and_kernels_reference(ckpt, tmp_path) -> None:
    off = quickstart(ckpt, "runtime:\n  native_decode: false\n", tmp_path)
    assert off.returncode == 0, off.stderr[-2000:]
    assert "native CPU decode forward off: runtime.native_decode=false" in off.stderr
    on = quickstart(ckpt, "runtime:\n  native_decode: false\n", tmp_path, MTP_CORE_NATIVE_DECODE="1")
    assert ran_isa(on) == table_for("auto")
    ref = quickstart(ckpt, "runtime:\n  kernels: reference\n", tmp_path)
    assert ref.returncode == 0, ref.stderr[-2000:]
    assert "torch reference kernels (runtime.kernels=reference)" in ref.stderr
    assert not ISA_LINE.search(ref.stderr)
    assert off.stdout == on.stdout == ref.stdout         # the same greedy text on every path


@pytest.mark.parametrize("yaml_text,env,needles", [
    ("runtime:\n  cpu_isa: avx9\n", {}, ("runtime.cpu_isa", "auto, amx, avx512, avx512f, avx2, generic", "avx9")),
    ("runtime:\n  kernels: fast\n", {}, ("runtime.kernels", "auto, reference")),
    ("runtime:\n  native_layout: tiled\n", {}, ("runtime.native_layout", "auto, direct, packed")),
    ("runtime:\n  device: tpu\n", {}, ("runtime.device", "auto, cpu, cuda, cuda:N")),
    ("runtime:\n  native_decode: maybe\n", {}, ("runtime.native_decode", "true or false")),
    ("runtime:\n  cpu_isa: generic\n", {"MTP_CORE_CPU_ISA": "avx9"},
     ("MTP_CORE_CPU_ISA='avx9'", "auto, amx, avx512, avx512f, avx2, generic")),
    ("runtime: {}\n", {"MTP_CORE_NATIVE_LAYOUT": "tiled"}, ("MTP_CORE_NATIVE_LAYOUT='tiled'", "auto, direct")),
    ("runtime: {}\n", {"MTP_CORE_DEVICE": "tpu"}, ("MTP_CORE_DEVICE='tpu'", "auto, cpu, cuda, cuda:N")),
])
def test_bad_value_is_one_error_line(ckpt, tmp_path, yaml_text, env, needles) -> None:
    line = one_error(quickstart(ckpt, yaml_text, tmp_path, **env))
    for needle in needles:
        assert needle in line, (needle, line)


# ---- the schema and the getters ----------------------------------------------------------------------
def test_yaml_section_parses_into_the_config() -> None:
    new = apply_yaml_options(LLMConfig(), {"runtime": {"kernels": "Reference", "cpu_isa": "AVX2",
                                                       "native_decode": False, "native_layout": "direct",
                                                       "device": "cpu"}}, {}, print)
    assert new.runtime == RuntimeConfig(kernels="reference", cpu_isa="avx2", native_decode=False,
                                        native_layout="direct", device="cpu")
    assert LLMConfig().runtime == RuntimeConfig()
    with pytest.raises(ConfigError, match=r"unknown key runtime\.isa; did you mean cpu_isa\?"):
        apply_yaml_options(LLMConfig(), {"runtime": {"isa": "avx2"}}, {}, print)
    bad = LLMConfig(runtime=RuntimeConfig(cpu_isa="sse"))
    with pytest.raises(ConfigError, match=r"runtime\.cpu_isa must be one of auto, amx, avx512, avx512f, avx2, "
                                          r"generic, got 'sse'"):
        bad.validate()


def test_config_value_under_the_env_override(monkeypatch) -> None:
    for var in (*runtime.ENV.values(), runtime.NATIVE_STEP_ENV):
        monkeypatch.delenv(var, raising=False)
    rc = RuntimeConfig(kernels="reference", cpu_isa="avx2", native_decode=False, native_layout="packed",
                       device="cpu")
    assert [runtime.setting(n, rc) for n in runtime.ENV] == ["reference", "avx2", False, "packed", "cpu"]
    assert runtime.source("native_decode", rc) == "runtime.native_decode=false"
    monkeypatch.setenv("MTP_CORE_CPU_ISA", "generic")
    monkeypatch.setenv("MTP_CORE_NATIVE_DECODE", "1")
    monkeypatch.setenv("MTP_CORE_NATIVE_LAYOUT", "")              # empty = unset
    assert runtime.setting("cpu_isa", rc) == "generic" and runtime.setting("native_decode", rc) is True
    assert runtime.setting("native_layout", rc) == "packed"
    assert runtime.source("cpu_isa", rc) == "MTP_CORE_CPU_ISA=generic"
    monkeypatch.setenv("MTP_CORE_NATIVE_DECODE", "sometimes")
    with pytest.raises(ConfigError, match=r"^MTP_CORE_NATIVE_DECODE='sometimes': use 1 or 0"):
        runtime.setting("native_decode", rc)


def test_device_and_native_step(monkeypatch) -> None:
    monkeypatch.delenv("MTP_CORE_DEVICE", raising=False)
    monkeypatch.delenv(runtime.NATIVE_STEP_ENV, raising=False)
    assert runtime.device(lambda: False) == "cpu" and runtime.device(lambda: True) == "cuda"
    assert runtime.device(lambda: True, RuntimeConfig(device="cuda:1")) == "cuda:1"
    assert runtime.device(lambda: True, RuntimeConfig(device="cpu")) == "cpu"
    with pytest.raises(ConfigError, match=r"^runtime.device=cuda but torch sees no CUDA device"):
        runtime.device(lambda: False, RuntimeConfig(device="cuda"))
    monkeypatch.setenv("MTP_CORE_DEVICE", "cuda:0")
    with pytest.raises(ConfigError, match=r"^MTP_CORE_DEVICE=cuda:0 but torch sees no CUDA device"):
        runtime.device(lambda: False, RuntimeConfig(device="cpu"))
    assert runtime.native_step(True) and not runtime.native_step(False)
    monkeypatch.setenv(runtime.NATIVE_STEP_ENV, "0")
    assert not runtime.native_step(True)


@needs_native
def test_configure_applies_the_process_wide_choices() -> None:
    """An engine's config re-resolves the kernels when their mode changes and hands C++ its ISA (a subprocess:
    the choices are the process's)."""
    code = ("from mtp_core import kernels\n"
            "from mtp_core.config import RuntimeConfig, runtime\n"
            "print(kernels.native_ops().cpu, kernels.cpu_isa())\n"
            "runtime.configure(RuntimeConfig(cpu_isa='generic'))\n"
            "print(kernels.native_ops().cpu, kernels.cpu_isa(), kernels.cpu_amx(), kernels.cpu_bf16_dot())\n"
            "runtime.configure(RuntimeConfig(kernels='reference'))\n"
            "print(kernels.native_ops().cpu, kernels.cpu_isa())\n"
            "runtime.configure(RuntimeConfig())\n"
            "print(kernels.native_ops().cpu, kernels.cpu_isa())\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300,
                       env={**BASE_ENV, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines() == [f"True {table_for('auto')}", "True generic False False", "False reference",
                                     f"True {table_for('auto')}"]


# ---- one reader of the environment -----------------------------------------------------------------------
ENV_READ = re.compile(r"(environ|getenv)\b[^\n]*MTP_(CORE|DIST)_")
# setup.py / setup_ext.py read the build switches (MTP_CORE_BUILD_EXT, MTP_CORE_CUDA_ARCHS) before any config
# exists; tests/ and scripts/ set the variables for the code under test
EXCEPT = {"mtp_core/config/runtime.py", "setup.py", "setup_ext.py"}


def test_no_file_but_runtime_reads_an_mtp_core_variable() -> None:
    """MTP_CORE_* and MTP_DIST_* (the collectives' timeout): torchrun's own variables (RANK, LOCAL_RANK, ...) are
    its launcher's contract and stay where the process group is set up."""
    files = [p for top in ("mtp_core", "cli", "csrc", "mtp_factory", "examples") if (REPO / top).is_dir()
             for p in (REPO / top).rglob("*") if p.suffix in (".py", ".cpp", ".h", ".cu", ".cuh")]
    files += [p for p in REPO.glob("*.py")]
    assert len(files) > 50
    readers = [f"{p.relative_to(REPO)}:{n}" for p in files if str(p.relative_to(REPO)) not in EXCEPT
               for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
               if ENV_READ.search(line)]
    assert not readers, readers
    text = (REPO / "mtp_core/config/runtime.py").read_text()
    assert all(var in text for var in (*runtime.ENV.values(), runtime.NATIVE_STEP_ENV, runtime.DIST_TIMEOUT_ENV))


def test_the_collectives_timeout_is_read_by_runtime(monkeypatch) -> None:
    monkeypatch.setenv("MTP_DIST_TIMEOUT_S", "12.5")
    assert runtime.dist_timeout_s(1800.0) == 12.5
    monkeypatch.setenv("MTP_DIST_TIMEOUT_S", "")
    assert runtime.dist_timeout_s(1800.0) == 1800.0
    for bad in ("soon", "0", "-3"):
        monkeypatch.setenv("MTP_DIST_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="MTP_DIST_TIMEOUT_S"):
            runtime.dist_timeout_s(1800.0)
