"""Shared fixtures: a tiny random causal LM built offline once per session, and isolated stores.

The suite is in three folders: ``unit/`` (pure functions, configs, keys, the plan: no trained model,
no pipeline run), ``integration/`` (the tiny model, stages, evaluation, the CLI in-process, one
store per module) and ``system/`` (servers, several processes, kills, whole pipeline runs, sweeps).
Every test under ``system/`` carries the ``system`` marker, so ``-m "not system"`` is the quick part.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Tests never reach a hub; fail fast instead of waiting on timeouts.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Idle OpenMP threads spin-wait; on a loaded 2-core machine that makes each small op ~100x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Prefect: an isolated ephemeral API per test session, never a developer's configured server.
os.environ.pop("PREFECT_API_URL", None)
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="posttrain-prefect-")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")  # as the CLI sets it
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.pop("MLFLOW_TRACKING_URI", None)

REPO_ROOT = Path(__file__).resolve().parents[1]
GSM8K_TRAIN = REPO_ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
SYSTEM_TESTS = Path(__file__).resolve().parent / "system"


def pytest_collection_modifyitems(config, items):
    """Mark what lies under system/; leave out ``slow`` tests unless ``-m`` names them, so that a
    selection such as ``-m "not system"`` does not pull in minutes of the built-in model."""
    for item in items:
        if item.path.is_relative_to(SYSTEM_TESTS):
            item.add_marker(pytest.mark.system)
    if "slow" in (config.option.markexpr or ""):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama + byte-level BPE tokenizer with a ChatML template (a few seconds)."""
    from posttrain.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def gsm8k_train_path() -> Path:
    """The real GSM8K train split beside the repository (../shared). CI always has it, so there a
    missing file is a failure, not a silent skip; elsewhere (a bare clone) the test is skipped."""
    if not GSM8K_TRAIN.exists():
        message = f"real GSM8K train split not found at {GSM8K_TRAIN}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return GSM8K_TRAIN


SPY_DIR = Path(__file__).resolve().parent / "spy"
"""step_spy.py and the sitecustomize.py that installs it in spawned worker processes."""


@pytest.fixture
def step_spy(monkeypatch, tmp_path_factory):
    """The steps that actually ran, in this process and in every worker process it spawns (a label
    saying `cached` proves nothing): a sequence of step names, with their spans and hooks
    (tests/spy/step_spy.py)."""
    monkeypatch.syspath_prepend(str(SPY_DIR))
    import step_spy as spy

    folder = tmp_path_factory.mktemp("step-spy")
    monkeypatch.setenv(spy.ENV, str(folder))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(SPY_DIR), os.environ.get("PYTHONPATH")]))
    )
    spy.install(folder, monkeypatch.setattr)
    return spy.CallLog(folder)


@pytest.fixture
def step_calls(step_spy):
    """Names of the step functions that actually ran, in order."""
    return step_spy
