"""benchmarks/gpu_check.sh: on a machine without CUDA every check is skipped with its reason, and
every check's overrides are valid config (a renamed key would otherwise surface only on a GPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
CHECKS = ("bf16-smoke", "qlora-grpo", "optim-8bit", "vllm-colocate", "ddp-2gpu")


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "BIN": str(Path(sys.executable).parent), **env}
    return subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path / "out")], cwd=ROOT, env=environ, capture_output=True, text=True
    )


def _summary(stdout: str) -> dict[str, str]:
    rows = stdout.split("last result line\n", 1)[1].splitlines()
    return {row.split()[0]: row for row in rows}


def test_without_cuda_every_check_is_skipped_with_its_reason(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the checks would run")
    done = _run(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _summary(done.stdout)
    assert set(rows) == set(CHECKS)
    assert all(" skip " in row for row in rows.values()), rows
    assert all("no CUDA device" in row for name, row in rows.items() if name != "ddp-2gpu"), rows


def test_every_check_is_a_valid_config(tmp_path):
    done = _run(tmp_path, GPU_CHECK_DRY_RUN="1")
    rows = _summary(done.stdout)
    assert set(rows) == set(CHECKS)
    for name, row in rows.items():
        if " skip " in row:  # only a launcher this version lacks may skip a dry run
            assert name == "ddp-2gpu" and "launch.launcher" in row, row
            continue
        log = (tmp_path / "out" / f"{name}.log").read_text()
        assert " ok " in row, log
        assert "eval-" in log and "run" in log, log  # the plan was printed
    assert done.returncode == 0, done.stdout + done.stderr
