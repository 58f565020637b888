"""Cache keys: each step's key names exactly what its output depends on.

A key is a sha256 over the step's name, the hash of its resolved config section (posttrain's
code-side trainer defaults included; the options that only say when checkpoints are written left
out, so changing them neither retrains a finished stage nor strands a killed one's checkpoints),
the fingerprints of its inputs (upstream model content, data
content), the posttrain version and the fingerprint of the code the step runs
(:mod:`posttrain.cache.code`). Prefect's default cache policy includes the flow-run id (never
reused across runs) and its INPUTS policy hashes a path string, not the files behind it, so keys are
built here.

Sections are hashed in their cache form (:func:`posttrain.core.config.cache_form`): a config key
renamed without changing what the step does is hashed under its old name, so the rename reruns
nothing.

A :class:`StepIdentity` also has a *lineage*: the key without the code. Records remember the code
of the key they were written under, so when a key is missing but its lineage has a record, the
planner can say the code changed, and which files.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import posttrain
from posttrain.cache.code import CodeFingerprint, code_fingerprint
from posttrain.cache.digests import sha256_file
from posttrain.core.config import DPOStageConfig, GRPOStageConfig, PipelineConfig, SFTStageConfig, cache_form
from posttrain.core.hashing import stable_hash
from posttrain.core.trainer_options import CHECKPOINT_OPTIONS

__all__ = [
    "StepIdentity",
    "cache_key",
    "data_identity",
    "data_key",
    "eval_identity",
    "eval_key",
    "score_identity",
    "stage_section",
    "train_identity",
    "train_key",
]


def cache_key(stage: str, config_hash: str, inputs: Mapping[str, str], code: str = "") -> str:
    """sha256 over everything a step's output depends on (24 hex characters)."""
    blob = json.dumps(
        {
            "stage": stage,
            "config": config_hash,
            "inputs": dict(sorted(inputs.items())),
            "posttrain": posttrain.__version__,
            **({"code": code} if code else {}),
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


@dataclass(frozen=True)
class StepIdentity:
    """Everything a step's key is made of."""

    step: str
    config_hash: str
    inputs: Mapping[str, str]
    code: CodeFingerprint

    @property
    def key(self) -> str:
        return cache_key(self.step, self.config_hash, self.inputs, self.code.digest)

    @property
    def lineage(self) -> str:
        """The key without the code: the same step, config and inputs under any code."""
        return cache_key(self.step, self.config_hash, self.inputs)


def _files_fingerprint(path: str | None) -> str:
    """Content hash of a local .jsonl file or folder (a path string says nothing about its content)."""
    if not path:
        return "-"
    root = Path(path)
    files = sorted(root.glob("*.jsonl")) if root.is_dir() else [root]
    digest = hashlib.sha256()
    for file in files:
        if file.exists():
            digest.update(file.name.encode())
            digest.update(sha256_file(file).encode())
    return digest.hexdigest()[:16]


def _source_fingerprint(cfg: PipelineConfig) -> str:
    return _files_fingerprint(cfg.data.path) if cfg.data.source == "local" else "-"


def _eval_files_fingerprint(cfg: PipelineConfig) -> dict[str, str]:
    """``{"eval_files": hash}`` over the content of every local evaluation file; {} when there is none."""
    files = [s.path for _, s in cfg.eval.all_sets() if s.data == "local"]
    if not files:
        return {}
    return {"eval_files": stable_hash([_files_fingerprint(f) for f in files])}


def _external_eval_sets(cfg: PipelineConfig) -> dict[str, str]:
    """``{"eval_sets": hash}`` of the evaluation sets not cut from the held-out slice, whose questions
    the data step removes from training (decontamination); {} when there is none."""
    sources = ("data", "path", "hub_split", "limit", "min_ops", "max_ops")
    # Which problems a synthetic set holds; hashed only when set, so that the keys of sets that
    # leave them at their defaults stay as they were before they were keyed.
    shape = ("numbers", "themes")
    sets = [
        {
            **{f: getattr(s, f) for f in sources},
            **{f: getattr(s, f) for f in shape if getattr(s, f) is not None},
            "content": _files_fingerprint(s.path),
        }
        for _, s in cfg.eval.all_sets()
        if s.data != "heldout"
    ]
    return {"eval_sets": stable_hash(sets)} if sets else {}


def _stage_sources(cfg: PipelineConfig) -> dict[str, str]:
    """``{"stage_sources": hash}`` of the GRPO stages' own ``data:`` sources (settings and local
    file content), which the data step prepares too; {} when no stage has one."""
    sources = {
        stage.step_name: {"data": cache_form(stage.data), "content": _files_fingerprint(stage.data.path)}
        for stage in cfg.grpo.stages
        if stage.data is not None
    }
    return {"stage_sources": stable_hash(sources)} if sources else {}


def data_identity(cfg: PipelineConfig, model_fingerprint: str) -> StepIdentity:
    # The tokenizer decides which prompts are too long, so the model's identity is an input.
    return StepIdentity(
        "data",
        stable_hash(cache_form(cfg.data)),
        {
            "source": _source_fingerprint(cfg),
            "tokenizer": model_fingerprint,
            **_external_eval_sets(cfg),
            **_stage_sources(cfg),
        },
        code_fingerprint("data"),
    )


def data_key(cfg: PipelineConfig, model_fingerprint: str) -> str:
    return data_identity(cfg, model_fingerprint).key


def stage_section(cfg: PipelineConfig, stage: str) -> SFTStageConfig | DPOStageConfig | GRPOStageConfig:
    """The config section of the training stage whose step name is ``stage``."""
    for _, section in cfg.stage_sections():
        if section.step_name == stage:
            return section
    raise KeyError(stage)


def train_identity(
    cfg: PipelineConfig,
    stage: str,
    model_fingerprint: str,
    data_fingerprint: str,
    selection_fingerprint: str = "",
    processes: int = 1,
) -> StepIdentity:
    """A training stage's identity, trained by ``processes`` processes. With ``keep: best`` its output is the checkpoint the selection
    slice preferred, so the slice's content (``selection_fingerprint``) is an input, and for SFT and
    DPO, whose in-training evaluation generates up to ``eval.max_completion_length``, that limit too; the
    choice itself (``keep``, ``select_metric``, ``patience``, ``eval_every``) is in the section."""
    section = stage_section(cfg, stage)
    trainer = {k: v for k, v in section.trainer.items() if k not in CHECKPOINT_OPTIONS}
    rft = getattr(section, "rft", None)
    # How the stage is launched is not what it trains on, but the number of processes is: each
    # takes its own per-device batch, so it multiplies the global batch. One process adds nothing,
    # so in-process keys are those of before launchers existed.
    # trainer_options() includes posttrain's code-side defaults, which the section hash does not.
    config_hash = stable_hash(
        {
            "stage": stable_hash(
                _without_lora(section.model_copy(update={"trainer": trainer, "launch": None}))
                if rft is None
                else _rft_stage_form(section)
            ),
            "trainer": {
                k: v
                for k, v in section.trainer_options().items()
                if k not in CHECKPOINT_OPTIONS and (rft is None or k in RFT_SAMPLING_OPTIONS)
            },
            "model": stable_hash(cache_form(cfg.model_for(section))),  # the stage's own `lora:` included
            "seed": cfg.seed,
            **({"processes": processes} if processes > 1 else {}),
            **_selection_settings(cfg, section),
            **_rft_settings(section),
        }
    )
    # an rft: stage pays no reward: the scoring's correctness decides what it trains on
    rewards = [spec.name for spec in getattr(section, "rewards", ())] if rft is None else []
    inputs = {"model": model_fingerprint, "data": data_fingerprint}
    if section.keep == "best":
        inputs["selection"] = selection_fingerprint or "-"
    return StepIdentity(stage, config_hash, inputs, code_fingerprint(code_kind(section), rewards))


def code_kind(section: SFTStageConfig | DPOStageConfig | GRPOStageConfig) -> str:
    """Whose code a stage runs (posttrain.cache.code): its TRL kind, or a ``grpo:`` stage's method
    (``rft`` when it fine-tunes)."""
    return getattr(section, "method", section.trl_kind)


RFT_SAMPLING_OPTIONS = ("temperature", "max_completion_length", "chat_template_kwargs")
"""The options of an ``rft:`` stage's own ``trainer:`` it reads: how its scoring samples and how long its
in-training evaluation generates. The rest are GRPO's (and ``grpo.defaults`` may set them for every
stage): changing them leaves its key alone."""
RFT_STAGE_KEYS = (
    "name",
    "rft",
    "tools",
    "tool_protocol",
    "environment_factory",
    "data",
    "data_filter",
    "pass_rate",
    "keep",
    "select_metric",
    "patience",
    "eval_every",
    "eval_limit",
)
"""The settings of an ``rft:`` stage its fine-tuning reads (its ``lora:`` enters as the model's)."""


def _rft_stage_form(section: GRPOStageConfig) -> dict[str, object]:
    """An ``rft:`` stage's section as its key holds it: :data:`RFT_STAGE_KEYS`, with checkpoint options
    left out of ``rft.trainer`` as they are of every stage's ``trainer``."""
    data = {k: v for k, v in cache_form(section).items() if k in RFT_STAGE_KEYS}
    rft = dict(data["rft"])
    rft["trainer"] = {k: v for k, v in rft.get("trainer", {}).items() if k not in CHECKPOINT_OPTIONS}
    return {**data, "rft": rft}


def _rft_settings(section: SFTStageConfig | DPOStageConfig | GRPOStageConfig) -> dict[str, object]:
    """An ``rft:`` stage's SFT options with posttrain's code-side defaults, which its section hash lacks."""
    rft = getattr(section, "rft", None)
    if rft is None:
        return {}
    return {"rft_trainer": {k: v for k, v in rft.trainer_options().items() if k not in CHECKPOINT_OPTIONS}}


def _selection_settings(
    cfg: PipelineConfig, section: SFTStageConfig | DPOStageConfig | GRPOStageConfig
) -> dict[str, object]:
    """What else ``keep: best`` chooses by, outside the section: SFT's and DPO's evaluation length."""
    if section.keep != "best" or section.trl_kind == "grpo":
        return {}
    return {"selection_max_new_tokens": cfg.eval.max_completion_length}  # named as first hashed


def _without_lora(section: SFTStageConfig | DPOStageConfig | GRPOStageConfig) -> dict[str, object]:
    """A stage section's JSON without its ``lora:``, which enters the key as part of the model it trains
    (``cfg.model_for``): restating ``model.lora`` in a stage then changes nothing."""
    data = cache_form(section)
    data.pop("lora", None)
    return data


def train_key(
    cfg: PipelineConfig,
    stage: str,
    model_fingerprint: str,
    data_fingerprint: str,
    selection_fingerprint: str = "",
    processes: int = 1,
) -> str:
    return train_identity(
        cfg, stage, model_fingerprint, data_fingerprint, selection_fingerprint, processes
    ).key


def eval_identity(
    cfg: PipelineConfig, step: str, model_fingerprint: str, data_fingerprint: str
) -> StepIdentity:
    """Identity of the evaluation step ``step`` (``eval-<stage>``) of a model on the evaluation sets
    (``eval:``, extra sets included, and the content of their local files)."""
    config_hash = stable_hash({"eval": stable_hash(cache_form(cfg.eval)), "precision": cfg.model.precision})
    inputs = {"model": model_fingerprint, "data": data_fingerprint, **_eval_files_fingerprint(cfg)}
    return StepIdentity(step, config_hash, inputs, code_fingerprint("eval"))


def eval_key(cfg: PipelineConfig, step: str, model_fingerprint: str, data_fingerprint: str) -> str:
    """Key of the evaluation step ``step`` (``eval-<stage>``) of a model on the eval split."""
    return eval_identity(cfg, step, model_fingerprint, data_fingerprint).key


SCORING_FIELDS = ("samples", "candidates")
"""What a ``score-<stage>`` step measures: the band, the weighting and ``retire_after`` only choose among
its pass rates at training time, so changing them reuses the scoring."""


def score_identity(
    cfg: PipelineConfig, stage: str, model_fingerprint: str, data_fingerprint: str
) -> StepIdentity:
    """Identity of the pass-rate scoring of GRPO stage ``stage`` (``grpo-<name>``): the model it starts
    from, the prepared train split, k and the candidates, and everything that shapes a sample (the
    stage's temperature, completion length, tools, chat-template options, data filter; the
    precision; the run's seed). The learning rate and every other training option are not in it: a
    new learning rate reuses it."""
    section = stage_section(cfg, stage)
    assert isinstance(section, GRPOStageConfig) and section.pass_rate is not None
    options = section.trainer_options()
    config_hash = stable_hash(
        {
            "pass_rate": {f: getattr(section.pass_rate, f) for f in SCORING_FIELDS},
            "sampling": {
                "temperature": options.get("temperature", 1.0),
                "max_completion_length": options["max_completion_length"],
                "tools": list(section.tools),
                "tool_protocol": section.tool_protocol,
                "environment_factory": section.environment_factory,
                # only when set, so the keys of stages without it stay as they were
                **(
                    {"chat_template_kwargs": options["chat_template_kwargs"]}
                    if options.get("chat_template_kwargs")
                    else {}
                ),
            },
            "data_filter": cache_form(section.data_filter),
            "precision": cfg.model.precision,
            "seed": cfg.seed,
        }
    )
    inputs = {"model": model_fingerprint, "data": data_fingerprint}
    return StepIdentity(f"score-{stage}", config_hash, inputs, code_fingerprint("score"))
