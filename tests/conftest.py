"""Shared fixtures: a tiny random causal LM built offline once per session, and isolated stores."""

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


STEP_FUNCTIONS = {
    "prepare_step": ("posttrain.pipeline.steps", None),
    "eval_step": ("posttrain.pipeline.steps", None),
    "sft_step": ("posttrain.pipeline.plan", "SFTStep"),
    "dpo_step": ("posttrain.pipeline.plan", "DPOStep"),
    "grpo_step": ("posttrain.pipeline.plan", "GRPOStep"),
}
"""What each step runs, by the name tests count it under: a function of the steps module, or a
training step's ``train``."""


@pytest.fixture
def step_calls(monkeypatch):
    """Names of the step functions that actually ran (a label saying `cached` proves nothing)."""
    import importlib

    calls: list[str] = []
    for name, (module, cls) in STEP_FUNCTIONS.items():
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        attr = "train" if cls else name
        real = getattr(owner, attr)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, attr, spy)
    return calls
