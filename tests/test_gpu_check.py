"""scripts/gpu_check.sh: its --dry_run walks every stage on the CPU against the torch references (so the first
GPU run does not stop on a broken line), and its test selection never picks files it cannot import."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402

STAGES = ("env", "build", "import", "tests", "memcheck", "racecheck", "bench", "decode")


def test_dry_run_walks_every_stage(tmp_path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    env.pop("MTP_CORE_KERNELS", None)
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--dry_run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    summary = out[out.index("== summary"):]
    for stage in STAGES:
        assert f"  {stage} " in summary, summary
    assert "gpu_check: all stages passed" in summary
    assert "FP8 MLA decode" in out and "  16  1   1" in out          # the H=16, Q=1 rows of the table
    assert "greedy MTP K=3 == plain, batch 1, graphs: True" in out
    log = (tmp_path / "gpu_check.log").read_text()                   # everything tee'd under $OUT
    assert "== summary" in log and "gpu-marked test files:" in log


def test_unknown_argument_is_one_line_error() -> None:
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--fast"], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "--fast" in proc.stderr


def _write(path: Path, text: str) -> None:
    path.write_text(text)


def test_selection_reads_files_without_importing_them(tmp_path) -> None:
    _write(tmp_path / "conftest.py", "import os\nimport pytest\n")
    mark = "import pytest\npytestmark = pytest.mark.gpu\n"
    _write(tmp_path / "test_serve_api.py", mark + "import fastapi\n")           # never, whatever it imports
    _write(tmp_path / "test_missing.py", mark + "import no_such_package_here\n")
    _write(tmp_path / "test_ok.py", "import pytest\n\n@pytest.mark.gpu\ndef test_x():\n    pass\n"
                                    "raise SystemExit('imported!')\n")
    _write(tmp_path / "test_cpu_only.py", "import torch\ndef test_y():\n    pass\n")
    chosen, skipped = gpu_check.select_test_files(tmp_path)
    assert [p.name for p in chosen] == ["test_ok.py"]
    assert len(skipped) == 1 and skipped[0].startswith("test_missing.py") and "no_such_package_here" in skipped[0]


def test_selection_of_this_repository() -> None:
    chosen, _ = gpu_check.select_test_files(ROOT / "tests")
    names = {p.name for p in chosen}
    assert {"test_kernels_gpu.py", "test_linear_gpu.py", "test_cuda_graphs.py"} <= names
    assert not any(n.startswith("test_serve") for n in names)
    assert "test_gpu_check.py" not in names and "test_kernels.py" not in names

