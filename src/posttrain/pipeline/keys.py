"""Cache keys: each step's key names exactly what its output depends on.

A key is a sha256 over the step's name, the hash of its resolved config section (posttrain's
code-side trainer defaults included), the fingerprints of its inputs (upstream model content, data
content) and the posttrain version. Prefect's default cache policy includes the flow-run id (never
reused across runs) and its INPUTS policy hashes a path string, not the files behind it, so the key
is built here and handed to Prefect as the task's explicit cache key.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import posttrain
from posttrain.core.config import DPOStageConfig, GRPOStageConfig, PipelineConfig, SFTStageConfig
from posttrain.core.hashing import sha256_file, stable_hash

__all__ = ["cache_key", "data_key", "eval_key", "stage_section", "train_key"]


def cache_key(stage: str, config_hash: str, inputs: Mapping[str, str]) -> str:
    """sha256 over everything a step's output depends on (24 hex characters)."""
    blob = json.dumps(
        {
            "stage": stage,
            "config": config_hash,
            "inputs": dict(sorted(inputs.items())),
            "posttrain": posttrain.__version__,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _source_fingerprint(cfg: PipelineConfig) -> str:
    """Content hash of local data files (a path string says nothing about what is in the file)."""
    if cfg.data.source != "local" or not cfg.data.path:
        return "-"
    root = Path(cfg.data.path)
    files = sorted(root.glob("*.jsonl")) if root.is_dir() else [root]
    digest = hashlib.sha256()
    for file in files:
        if file.exists():
            digest.update(file.name.encode())
            digest.update(sha256_file(file).encode())
    return digest.hexdigest()[:16]


def data_key(cfg: PipelineConfig, model_fingerprint: str) -> str:
    # The tokenizer decides which prompts are too long, so the model's identity is an input.
    return cache_key(
        "data", stable_hash(cfg.data), {"source": _source_fingerprint(cfg), "tokenizer": model_fingerprint}
    )


def stage_section(cfg: PipelineConfig, stage: str) -> SFTStageConfig | DPOStageConfig | GRPOStageConfig:
    """The config section of the training stage whose step name is ``stage``."""
    sections = [s for s in (cfg.sft, cfg.dpo, *cfg.grpo.stages) if s is not None]
    for section in sections:
        if section.step_name == stage:
            return section
    raise KeyError(stage)


def train_key(cfg: PipelineConfig, stage: str, model_fingerprint: str, data_fingerprint: str) -> str:
    section = stage_section(cfg, stage)
    # trainer_options() includes posttrain's code-side defaults, which the section hash does not.
    config_hash = stable_hash(
        {
            "stage": stable_hash(section),
            "trainer": section.trainer_options(),
            "model": stable_hash(cfg.model),
            "seed": cfg.seed,
        }
    )
    return cache_key(stage, config_hash, {"model": model_fingerprint, "data": data_fingerprint})


def eval_key(cfg: PipelineConfig, step: str, model_fingerprint: str, data_fingerprint: str) -> str:
    """Key of the evaluation step ``step`` (``eval-<stage>``) of a model on the eval split."""
    config_hash = stable_hash({"eval": stable_hash(cfg.eval), "precision": cfg.model.precision})
    return cache_key(step, config_hash, {"model": model_fingerprint, "data": data_fingerprint})
