"""The typed schema of one pipeline run, loaded from YAML.

One YAML file describes one whole run (model, data, optional SFT and DPO, ordered GRPO stages,
evaluation, tracking, orchestration). Every section forbids unknown keys, and each stage's
``trainer:`` mapping is checked against the real TRL config class at load time, so a typo such as
``kl_coef`` fails in a second instead of after hours of training. Hardware (bf16, 4-bit, vLLM) is
deliberately *not* checked here: a GPU config must validate on a laptop; the stage checks the
hardware when it starts.

Names follow one rule per kind of value, so a key says what it counts. ``limit`` keeps the first N
of something in a fixed order (null: all): ``data.limit``, ``sft.limit``, a GRPO stage's
``data_filter.limit``, ``eval.limit`` and each extra set's, and ``eval_limit`` (a stage's
in-training evaluation, ``eval_`` as in ``eval_every``). ``*_size`` is a slice set aside from the
training records: ``data.eval_size``, ``data.selection_size``. ``num_*`` is how many posttrain
generates or draws: ``data.synthetic.num_examples`` (problems), ``dpo.num_prompts`` (prompts drawn
with the run's seed) and ``dpo.num_generations`` (completions per prompt, TRL's word). Completion
length is TRL's ``max_completion_length`` wherever posttrain generates (DPO's samples, evaluation).
A renamed key fails with its new name (``renamed_keys`` on each section), and cache keys hash it
under its old one (:func:`cache_form`), so a rename reruns nothing.

Secrets never leave a config through JSON: every section's JSON form (``model_dump(mode="json")``,
which is what MLflow params, ``config.yaml``, ``stage.json``, config hashes and Prefect's stored
flow-run parameters are built from) passes through :func:`posttrain.core.redact.redact`; the Python
objects keep the real values for the code that needs them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from posttrain.core.errors import ConfigError, yaml_boolean_hint
from posttrain.core.inputs import YAMLLimitError, check_config_values, load_yaml_bounded, path_problem
from posttrain.core.keep_best import SelectMetric, check_selection
from posttrain.core.library_policy import check_attn_implementation, check_server_args
from posttrain.core.metric_names import is_ops_slice
from posttrain.core.peft_options import (
    LORA_ALIASES,
    POSTTRAIN_LORA_KEYS,
    check_lora_config,
    validate_lora_options,
)
from posttrain.core.prompts import DEFAULT_SYSTEM_PROMPT, FEW_SHOT_EXAMPLES
from posttrain.core.redact import redact
from posttrain.core.stage_defaults import from_defaults, inherited_keys, merge_stage, written_location
from posttrain.core.trainer_options import TRAINER_DEFAULTS, generation_blockers, validate_trainer_options

__all__ = [
    "ConfigError",
    "DataConfig",
    "DataSource",
    "StageDataSource",
    "DPOStageConfig",
    "EvalConfig",
    "EvalSetConfig",
    "GRPOStageConfig",
    "LaunchConfig",
    "LaunchOverride",
    "ModelConfig",
    "PassRateConfig",
    "PipelineConfig",
    "RewardSpec",
    "SFTStageConfig",
    "TrackingConfig",
    "VLLMServerConfig",
    "apply_override",
    "dump_config",
    "parse_config",
    "read_config_mapping",
]


_CACHE_FORM = "posttrain.cache_form"


SEED_LIMIT = 2**32
"""Seeds lie in [0, 2**32): numpy's, which transformers' ``set_seed`` calls at a stage's start."""


class _KeyProblem(ValueError):
    """A problem with one key of a section, raised by the section: the error is located at the key."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key, self.problem = key, problem


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False, use_attribute_docstrings=True)
    omit_when_default: ClassVar[tuple[str, ...]] = ()
    """Keys left out of the JSON form while they hold their default: a key added to a section
    leaves the config hashes (cache keys) of configs that do not use it as they were."""
    renamed_keys: ClassVar[dict[str, tuple[str, str]]] = {}
    """Keys this section had under another name: ``old -> (new, why)``. The old key fails
    validation with ``<key>: renamed to '<new>' (<why>)`` instead of "unknown key"."""
    cache_names: ClassVar[dict[str, str]] = {}
    """``new -> old`` for renamed keys whose step did not change: :func:`cache_form` hashes them
    under the old name, so a rename moves no cache key."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_renamed_keys(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for old, (new, why) in cls.renamed_keys.items():
                if old in value:
                    raise _KeyProblem(old, f"renamed to '{new}' ({why})")
        return value

    @model_serializer(mode="wrap", when_used="json")
    def _redacted(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        """The JSON form, which everything that leaves the process is built from, without secrets."""
        data = self._json_form(redact(handler(self)))
        if isinstance(data, dict) and info.context and info.context.get(_CACHE_FORM):
            data = self._cache_form(data)
        return data

    def _json_form(self, data: Any) -> Any:
        return self._without_defaults(data)

    def _cache_form(self, data: dict[str, Any]) -> dict[str, Any]:
        return {self.cache_names.get(key, key): value for key, value in data.items()}

    def _without_defaults(self, data: Any) -> Any:
        if isinstance(data, dict):
            for key in self.omit_when_default:
                default = type(self).model_fields[key].get_default(call_default_factory=True)
                if key in data and data[key] == default:
                    del data[key]
        return data


def cache_form(section: BaseModel) -> Any:
    """A section's JSON form as cache keys hash it: renamed keys under the names they had when the
    keys were first computed (``cache_names``), so renaming a key reruns nothing. Everything else
    (MLflow params, ``config.yaml``, ``stage.json``) shows the current names."""
    return section.model_dump(mode="json", context={_CACHE_FORM: True})


ToolName = Literal["calculator"]
"""Tools of the ``inline`` protocol, which posttrain's generation engine runs inside a completion
with any model (see posttrain.core.calculator)."""
ToolProtocol = Literal["inline", "chat"]


def _check_tool_names(tools: list[str], protocol: str, environment_factory: str | None) -> None:
    """``inline``: engine tools only; ``chat``: built-in tools or ``package.module:function``."""
    for name in tools:
        custom = ":" in name
        if protocol == "inline" and name not in get_args(ToolName):
            hint = " (custom tools run in TRL's chat protocol: tool_protocol: chat)" if custom else ""
            raise ValueError(
                f"tools: unknown inline tool {name!r}; inline tools are {list(get_args(ToolName))}{hint}"
            )
        if protocol == "chat" and not custom and name not in get_args(ToolName):
            raise ValueError(
                f"tools: unknown tool {name!r}; built-in tools are {list(get_args(ToolName))}, "
                "or name 'package.module:function'"
            )
    if environment_factory is not None:
        if protocol != "chat":
            raise ValueError(
                "environment_factory: environments are TRL's chat protocol; set tool_protocol: chat"
            )
        if ":" not in environment_factory:
            raise ValueError(
                f"environment_factory: {environment_factory!r} must look like 'package.module:Factory'"
            )


class _ToolFields(StrictModel):
    """The tool settings a GRPO stage and an evaluation share."""

    omit_when_default: ClassVar[tuple[str, ...]] = ("tools", "tool_protocol", "environment_factory")
    tools: list[str] = Field(default_factory=list)
    """Tools the model may use while it generates (off by default). ``inline`` protocol:
    ``[calculator]``, posttrain's engine computes ``expression =`` and writes the value (any model).
    ``chat`` protocol: tool functions called through the chat template, TRL's
    ``GRPOTrainer(tools=...)``: the built-in ``calculator`` or ``package.module:function`` (imported
    only with ``--allow-custom-code``)."""
    tool_protocol: ToolProtocol = "inline"
    """``inline`` (posttrain's text protocol; no tool-calling template needed) or ``chat`` (TRL's tool
    calling through the model's chat template, checked with TRL's ``supports_tool_calling``)."""
    environment_factory: str | None = None
    """``chat`` only: ``package.module:Factory`` passed as TRL's ``environment_factory`` (one
    environment per example, reset with it; its public methods are tools). Custom code: needs
    ``--allow-custom-code``."""

    @model_validator(mode="after")
    def _tool_names(self) -> _ToolFields:
        _check_tool_names(self.tools, self.tool_protocol, self.environment_factory)
        return self

    def uses_tools(self) -> bool:
        return bool(self.tools or self.environment_factory)


# `training:` beside `trainer:` on every stage read as one thing said twice; it holds how a stage is
# launched, so it is `launch:` (the stage's TRL options are `trainer:`).
_LAUNCH_RENAMED = {"training": ("launch", "how stages are launched; TRL's options stay in trainer:")}


class LaunchOverride(StrictModel):
    """A stage's ``launch:``: any of the top-level ``launch:`` keys, for this stage only (unset
    keys fall back to the top-level section)."""

    launcher: Literal["inprocess", "accelerate"] | None = None
    """``inprocess`` or ``accelerate`` for this stage (default: ``launch.launcher``)."""
    accelerate_config: str | None = None
    """An accelerate config file for this stage (default: ``launch.accelerate_config``)."""
    num_processes: int | None = Field(None, ge=1)
    """World size for this stage (default: ``launch.num_processes``)."""


class LaunchConfig(StrictModel):
    """``launch:``: how training stages are started (each stage may override it in ``launch:``).

    inprocess: in the pipeline's own process (the Prefect task's). accelerate: as a child process
    tree, ``accelerate launch --config_file <accelerate_config> -m posttrain.pipeline.stage_main``,
    which writes the stage output like an in-process stage; the parent reads the result back from
    the output directory. See posttrain.pipeline.launcher.
    """

    launcher: Literal["inprocess", "accelerate"] = "inprocess"
    """``inprocess``: stages train in the pipeline's own process; ``accelerate``: each stage runs
    under ``accelerate launch`` in processes of its own, whose memory is gone when it ends."""
    accelerate_config: str | None = None
    """An accelerate config file (relative to the working directory). Default:
    ``configs/accelerate/ddp.yaml`` on a machine with CUDA, ``configs/accelerate/cpu.yaml``
    (2 processes, gloo) without."""
    num_processes: int | None = Field(None, ge=1)
    """Overrides the accelerate config's ``num_processes`` (the world size)."""

    def merged(self, override: LaunchOverride | None) -> LaunchConfig:
        """This section with a stage's ``launch:`` keys in place of the ones it sets."""
        if override is None:
            return self
        return self.model_copy(update=override.model_dump(exclude_none=True))


class VLLMServerConfig(StrictModel):
    """``vllm_server:``: a vLLM generation server that posttrain starts and stops itself.

    GRPO stages whose ``trainer:`` sets ``use_vllm: true, vllm_mode: server`` get one for the length
    of the stage: ``vllm serve`` with TRL's flags on ``gpus``, serving the stage's input model; posttrain waits
    for its ``/health`` answer, sets the stage's ``vllm_server_host``/``vllm_server_port``, and stops
    the server's whole process group when the stage ends or fails. See
    posttrain.generation.vllm_server.
    """

    gpus: list[int] = Field(min_length=1)
    """CUDA device indices the server runs on (its ``CUDA_VISIBLE_DEVICES``, so as ``nvidia-smi``
    numbers them, whatever the pipeline's own ``CUDA_VISIBLE_DEVICES``); keep them apart from the
    training processes' GPUs. More than one: tensor parallel over them unless ``extra_args``
    sets ``--tensor_parallel_size`` or ``--data_parallel_size``."""
    host: str = "127.0.0.1"
    """Address the server binds and the trainer connects to; loopback keeps it off the network."""
    port: int = Field(8000, ge=1, le=65535)
    """Port the server listens on and the trainer connects to."""
    timeout_s: float = Field(600.0, gt=0)
    """How long to wait for the server's health check (loading and compiling a model takes minutes)."""
    extra_args: list[str] = Field(default_factory=list)
    """More server options, in ``trl vllm-serve``'s words (``--gpu_memory_utilization``, ``0.9``),
    which TRL turns into ``vllm serve`` flags; spelled in full and from an allow list unless custom
    code is allowed (:mod:`posttrain.core.library_policy`), which also lets other ``vllm serve``
    flags through as written. ``--model``, ``--host``, ``--port`` and ``--revision`` are posttrain's."""

    @field_validator("gpus")
    @classmethod
    def _distinct_gpus(cls, gpus: list[int]) -> list[int]:
        if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
            raise ValueError(f"GPU indices must be distinct and >= 0, got {gpus}")
        return gpus

    @field_validator("extra_args", mode="before")
    @classmethod
    def _numbers_as_text(cls, args: Any) -> Any:
        """``[--gpu_memory_utilization, 0.9]`` reads as YAML numbers; a command line is text."""
        if isinstance(args, list):
            return [str(a) if isinstance(a, int | float) and not isinstance(a, bool) else a for a in args]
        return args

    @field_validator("extra_args")
    @classmethod
    def _allowed_flags(cls, args: list[str]) -> list[str]:
        return check_server_args(args)


class LoraConfig(StrictModel):
    """``model.lora``: posttrain's four settings plus any other ``peft.LoraConfig`` option by peft's
    own name (``use_rslora``, ``use_dora``, ``modules_to_save``, ``init_lora_weights``, ...), checked
    by building the real ``LoraConfig`` (see :mod:`posttrain.core.peft_options`)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    r: int = Field(16, ge=1)
    """Rank of the adapter matrices: its capacity, and its size."""
    alpha: int = Field(32, ge=1)
    """peft's ``lora_alpha`` (either name is accepted)."""
    dropout: float = Field(0.05, ge=0, lt=1)
    """peft's ``lora_dropout`` (either name is accepted)."""
    target_modules: list[str] | str = "all-linear"
    """Module names, ``all-linear``, or a regular expression (peft's rules)."""

    @model_validator(mode="before")
    @classmethod
    def _peft_options(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value
        value = dict(value)
        for peft_name, ours in LORA_ALIASES.items():
            if peft_name in value:
                if ours in value:
                    raise ValueError(f"give '{ours}' or peft's '{peft_name}', not both")
                value[ours] = value.pop(peft_name)
        extra = {k: v for k, v in value.items() if k not in POSTTRAIN_LORA_KEYS}
        return {**value, **validate_lora_options(extra)}

    @model_validator(mode="after")
    def _real_lora_config(self) -> LoraConfig:
        check_lora_config(self.peft_options())
        return self

    def peft_options(self) -> dict[str, Any]:
        """Keyword arguments of ``peft.LoraConfig`` (without ``task_type``), by peft's names."""
        ours = {peft: getattr(self, name) for name, peft in POSTTRAIN_LORA_KEYS.items()}
        return {**ours, **(self.model_extra or {})}


_SELECTION_KEYS = ("keep", "select_metric", "patience")
"""Every stage's checkpoint selection (posttrain.core.keep_best): left out of its hash while unset."""


class _StageWithTrainer(StrictModel):
    trl_kind: ClassVar[str]
    omit_when_default: ClassVar[tuple[str, ...]] = ("tools", *_SELECTION_KEYS)
    trainer: dict[str, Any] = Field(default_factory=dict, description="TRL options, passed through")
    renamed_keys: ClassVar[dict[str, tuple[str, str]]] = _LAUNCH_RENAMED
    derived_defaults: ClassVar[dict[str, str]] = {
        "launch": "as the top-level launch",
        "lora": "as model.lora",
    }
    launch: LaunchOverride | None = None
    """How this stage is launched, over the top-level ``launch:`` section; only the number of
    processes enters the stage's cache key (see posttrain.cache.keys)."""
    lora: LoraConfig | None = None
    """This stage's own ``model.lora``: a mapping trains a LoRA adapter, ``null`` the full model;
    absent, the stage follows ``model.lora`` (see :meth:`PipelineConfig.model_for`)."""
    keep: Literal["last", "best"] = "last"
    """The stage's output: its last step's policy, or (``best``) the checkpoint that scored highest on
    ``select_metric`` in the in-training evaluations (``eval_every``) of the selection slice
    (``data.selection_size``). See posttrain.core.keep_best."""
    select_metric: SelectMetric = "accuracy"
    """What ``keep: best`` maximises: strict ``accuracy``, ``accuracy_flexible`` or ``format``."""
    patience: int | None = Field(None, ge=1)
    """With ``keep: best``: stop after this many evaluations without a new best (null: never)."""

    @model_validator(mode="after")
    def _selection_works(self) -> _StageWithTrainer:
        check_selection(self.keep, getattr(self, "eval_every", None), self.patience, self.trainer)
        return self

    def _json_form(self, data: Any) -> Any:
        """Without ``launch`` or ``lora`` when unset: a stage's config hash (cache key, ``stage.json``)
        stays what it was before stages could override them."""
        data = self._without_defaults(data)
        if isinstance(data, dict):
            if data.get("launch") is None:
                data.pop("launch", None)
            if "lora" not in self.model_fields_set:
                data.pop("lora", None)
        return data

    @field_validator("trainer")
    @classmethod
    def _check_trainer(cls, value: dict[str, Any]) -> dict[str, Any]:
        return validate_trainer_options(cls.trl_kind, value)

    def trainer_options(self) -> dict[str, Any]:
        """posttrain's defaults overlaid with this stage's YAML options."""
        return {**TRAINER_DEFAULTS[self.trl_kind], **self.trainer}


# --------------------------------------------------------------------------- sections


class ModelConfig(StrictModel):
    name: str
    """Hub id, local HF directory, local .gguf file, or a built-in (`smollm2-135m-instruct`, `tiny-random`)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) of a hub model; null: the default branch."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """``auto``: bf16 on GPUs that support it (fp16 on older ones) and on CPUs with AMX or
    AVX512-BF16, else fp32.
    Evaluations compare only at the same precision (bf16 flips greedy near-ties)."""
    quantization: Literal["none", "4bit"] = "none"
    """``4bit``: bitsandbytes NF4 with double quantization, for QLoRA (needs CUDA and ``lora``)."""
    attn_implementation: str | None = None
    """Passed to transformers (``sdpa``, ``eager``, ``flash_attention_2``); null: its default.
    Hub kernels are refused unless custom code is allowed."""
    lora: LoraConfig | None = None
    """LoRA settings; null means full fine-tuning."""
    adapter_policy: Literal["merge", "adapter"] = "merge"
    """merge: every stage writes a standalone model; adapter: only the adapter, recording its base."""
    cache_dir: str | None = None
    """Where built-in models are fetched and converted (default ``$POSTTRAIN_CACHE/models``, else
    ~/.cache/posttrain/models)."""

    @field_validator("attn_implementation")
    @classmethod
    def _attention_without_hub_code(cls, name: str | None) -> str | None:
        check_attn_implementation(name)
        return name

    @model_validator(mode="after")
    def _quantization_needs_lora(self) -> ModelConfig:
        if self.quantization == "4bit" and self.lora is None:
            raise ValueError("quantization: 4bit trains adapters only (QLoRA); add a `lora:` section")
        return self


# "steps" meant three things in one config (pipeline steps, optimizer steps, arithmetic operations
# per problem); the last are now `ops`. Old keys fail with the new name instead of "unknown key".
_OPS_RENAMES = {
    "min_steps": ("min_ops", "arithmetic operations per problem"),
    "max_steps": ("max_ops", "arithmetic operations per problem"),
}


SyntheticTheme = Literal[
    "shopping",
    "savings",
    "baking",
    "ages",
    "scores",
    "travel",
    "classroom",
    "discounts",
    "farm",
    "reading",
    "fundraiser",
]
"""The generator's stories (posttrain.data.synthetic.THEME_NAMES, which a test holds equal to this)."""


class SyntheticConfig(StrictModel):
    """``data.synthetic``: posttrain's problem generator, seeded by ``data.seed``."""

    omit_when_default: ClassVar[tuple[str, ...]] = ("themes",)

    num_examples: int = Field(1000, ge=1)
    """Problems generated."""
    min_ops: int = Field(1, ge=1)
    """Fewest arithmetic operations in a problem (1 = one operation)."""
    max_ops: int = Field(4, ge=1)
    """Most arithmetic operations in a problem."""
    numbers: Literal["default", "small"] = "default"
    """Size of the quantities: the default ranges (up to a few thousand) or ``small`` (below 120)."""
    themes: list[SyntheticTheme] | None = Field(None, min_length=1)
    """The stories problems come from (null: all eleven). Train on some and evaluate on the others
    (an evaluation set's ``themes``) to measure phrasings the model never saw."""
    renamed_keys: ClassVar[dict[str, tuple[str, str]]] = {
        **_OPS_RENAMES,
        "seed": ("data.seed", "one seed for the generated problems and the split; see the top-level seed"),
    }

    @model_validator(mode="after")
    def _ordered(self) -> SyntheticConfig:
        if self.min_ops > self.max_ops:
            raise ValueError(f"min_ops ({self.min_ops}) > max_ops ({self.max_ops})")
        return self


class DataSource(StrictModel):
    """Where questions come from: the keys ``data`` and a GRPO stage's own ``data`` share."""

    source: Literal["hub", "local", "synthetic"] = "synthetic"
    """``hub`` (a GSM8K-format dataset on the Hugging Face Hub), ``local`` (``path``) or
    ``synthetic`` (posttrain's generator of multi-step word problems)."""
    path: str | None = None
    """local: a .jsonl file or a folder of *.jsonl in the official GSM8K format."""
    hub_id: str = "openai/gsm8k"
    """Dataset repository of the ``hub`` source."""
    hub_config: str = "main"
    """Dataset configuration of the ``hub`` source (GSM8K's is ``main``)."""
    split: str = "train"
    """Split of the ``hub`` source that is read (``data``'s held-out slice is cut from it too)."""
    synthetic: SyntheticConfig = SyntheticConfig()
    """Generator settings of the ``synthetic`` source."""
    limit: int | None = Field(None, ge=1)
    """Read the first N valid records of the source, in file order (synthetic: at most N generated);
    null: all."""

    @model_validator(mode="after")
    def _local_needs_path(self) -> DataSource:
        if self.source == "local" and not self.path:
            raise ValueError("source: local needs `path` (a .jsonl file or folder)")
        return self


class StageDataSource(DataSource):
    """A GRPO stage's own ``data:``: a source, and optionally a selection slice cut from it."""

    omit_when_default: ClassVar[tuple[str, ...]] = ("selection_size",)
    selection_size: int = Field(0, ge=0)
    """Records of this source set aside for the stage's in-training evaluations and ``keep: best``
    in place of the run's selection slice, so the stage chooses its checkpoint by the questions it
    learns to answer: never trained on by any stage, and decontaminated against every evaluation
    set, the run's held-out and selection slices, the run's training records and the stage's
    prompts. Needs ``eval_every``. 0: the run's selection slice (else its held-out slice)."""

    @model_validator(mode="after")
    def _prompts_left(self) -> StageDataSource:
        if self.source == "synthetic" and self.selection_size:
            made = min(self.synthetic.num_examples, self.limit or self.synthetic.num_examples)
            if self.selection_size >= made:
                raise ValueError(
                    f"selection_size: {self.selection_size} of the {made} synthetic problems leaves none to train on"
                )
        return self


class DataConfig(DataSource):
    omit_when_default: ClassVar[tuple[str, ...]] = ("selection_size",)
    eval_size: int = Field(100, ge=1)
    """Held-out validation slice taken from the training records."""
    selection_size: int = Field(0, ge=0)
    """Training records set aside, after the held-out slice, to choose checkpoints on (``keep: best``)
    and for in-training evaluations: never trained on, never evaluated on at the end, decontaminated
    against every evaluation set. 0: none."""
    seed: int = Field(0, ge=0, lt=SEED_LIMIT)
    """The data step's seed (the held-out and selection slices, the synthetic problems): fixed, not
    the run's; see the top-level ``seed``."""
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    """System message of every prompt; the default asks for the ``<reasoning>``/``<answer>`` format
    that the format rewards and strict accuracy read."""
    few_shot: int = Field(0, ge=0, le=len(FEW_SHOT_EXAMPLES))
    """Built-in worked examples prepended to every prompt (there are as many as FEW_SHOT_EXAMPLES)."""
    max_prompt_tokens: int = Field(512, ge=8)
    """Prompts longer than this are dropped and counted: TRL never truncates prompts."""
    decontamination_ngram: int | None = Field(8, ge=3)
    """Training records sharing an n-gram of this length with an evaluation question are
    dropped (decontamination); null disables it."""
    on_bad_record: Literal["error", "skip"] = "error"
    """``error`` stops at the bad record (``file:line: problem``); ``skip`` skips and counts it."""

    def source_of(self, stage: Any) -> DataConfig:
        """The data settings a GRPO stage's prompts are prepared with: these, with the stage's own
        ``data:`` source keys in place of the run's when it sets one (seed, prompt and filters stay)."""
        own = getattr(stage, "data", None)
        if own is None:
            return self
        update = {name: getattr(own, name) for name in DataSource.model_fields}
        return self.model_copy(update={**update, "selection_size": own.selection_size})

    def _cache_form(self, data: dict[str, Any]) -> dict[str, Any]:
        """The generator's seed was ``data.synthetic.seed`` until it became ``data.seed``."""
        data = super()._cache_form(data)
        if isinstance(data.get("synthetic"), dict):
            data["synthetic"] = {**data["synthetic"], "seed": data["seed"]}
        return data


class RewardSpec(StrictModel):
    """One reward of a stage. That the name resolves is checked a layer up, where the rewards live
    (:func:`posttrain.pipeline.validation.check_rewards`): the schema cannot import them."""

    name: str
    """A registered reward (see `posttrain rewards list`) or `package.module:function`."""
    weight: float = 1.0
    """Multiplier of this reward in the stage's total (TRL's ``reward_weights``)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Settings of a reward factory (``length``: ``{min_tokens, max_tokens}``) or of the adaptive
    scaler; see ``posttrain.rewards.registry.build_reward``."""
    on_error: Literal["fail", "zero", "skip"] = "fail"
    """When the reward raises on an example: stop the stage naming it (fail), score it 0.0 (zero),
    or leave it unscored like a None (skip). See posttrain.rewards.guard."""


_EVAL_KEYS = ("eval_every", "eval_limit")
"""In-training evaluation keys SFT and DPO gained after GRPO: left out of their hashes while unset."""

# One word per kind of count (see the module docstring); the old spellings fail with the new one.
_LIMIT = ("limit", "the first N: `limit`, as in data.limit and eval.limit")
_COMPLETION_LENGTH = ("max_completion_length", "TRL's name for the completion length, as in trainer:")
_NUM_GENERATIONS = ("num_generations", "TRL's name for completions per prompt, as in GRPO's trainer:")


class SFTStageConfig(_StageWithTrainer):
    trl_kind: ClassVar[str] = "sft"
    step_name: ClassVar[str] = "sft"
    omit_when_default: ClassVar[tuple[str, ...]] = (*_StageWithTrainer.omit_when_default, *_EVAL_KEYS)
    renamed_keys: ClassVar[dict[str, tuple[str, str]]] = {**_LAUNCH_RENAMED, "num_examples": _LIMIT}
    cache_names: ClassVar[dict[str, str]] = {"limit": "num_examples"}
    enabled: bool = True
    """false skips the stage and keeps its settings in the file."""
    limit: int | None = Field(None, ge=1)
    """Train on the first N prepared examples; null: all of them."""
    eval_every: int | None = Field(None, ge=1)
    """Evaluate greedily on the selection slice (else the held-out slice) at the start and every N
    steps (``eval/accuracy``, ...; what ``keep: best`` chooses by); null: no in-training evaluation."""
    eval_limit: int = Field(64, ge=1)
    """Questions per in-training evaluation."""
    tools: list[ToolName] = Field(default_factory=list)
    """``[calculator]``: targets are written the way the inline calculator completes them (each
    annotated step as ``expression = value``), so the model learns to write the expression and let
    the tool write the value. Train and evaluate later stages with the same tool."""


class DPOStageConfig(_StageWithTrainer):
    trl_kind: ClassVar[str] = "dpo"
    step_name: ClassVar[str] = "dpo"
    omit_when_default: ClassVar[tuple[str, ...]] = (*_StageWithTrainer.omit_when_default, *_EVAL_KEYS)
    renamed_keys: ClassVar[dict[str, tuple[str, str]]] = {
        **_LAUNCH_RENAMED,
        "max_new_tokens": _COMPLETION_LENGTH,
        "samples_per_prompt": _NUM_GENERATIONS,
    }
    cache_names: ClassVar[dict[str, str]] = {
        "max_completion_length": "max_new_tokens",
        "num_generations": "samples_per_prompt",
    }
    enabled: bool = True
    """false skips the stage and keeps its settings in the file."""
    eval_every: int | None = Field(None, ge=1)
    """As ``sft.eval_every``."""
    eval_limit: int = Field(64, ge=1)
    """Questions per in-training evaluation."""
    num_prompts: int = Field(64, ge=1)
    """Training prompts drawn at random (with the run's ``seed``) and sampled on-policy to build
    preference pairs."""
    num_generations: int = Field(4, ge=2)
    """Completions sampled per prompt: the pair's chosen text is the best-scoring one (the reference
    solution when none is correct), its rejected text the worst."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the on-policy samples; a low one samples the loops greedy decoding
    falls into, so DPO can unlearn them."""
    max_completion_length: int = Field(256, ge=1)
    """Token limit of each on-policy sample."""
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="correctness"), RewardSpec(name="strict_format", weight=0.5)]
    )
    """Rewards that rank a prompt's samples to choose the preferred and the rejected completion."""
    tools: list[ToolName] = Field(default_factory=list)
    """``[calculator]``: on-policy samples are generated with the inline calculator, and a reference
    solution chosen in their place is written for it (as ``sft.tools``). The tool's tokens are part
    of the pairs' text: DPO's loss, unlike GRPO's, has no mask for them."""


class MonitorConfig(StrictModel):
    """Thresholds of the GRPO health monitor; see training/health.py for what each alert means."""

    on_alert: Literal["warn", "stop"] = "warn"
    """``warn`` logs each alert and carries on; ``stop`` ends training at the first one."""
    window: int = Field(10, ge=2)
    """Reward steps the ``no_signal`` mean and the ``flat_reward`` trend are taken over."""
    zero_std_threshold: float = Field(0.9, gt=0, le=1)
    """Share of prompt groups without signal (all completions scored alike) at or above which
    the stage alerts ``no_signal``: GRPO learns nothing from such groups."""
    kl_threshold: float = Field(1.0, gt=0)
    """KL to the reference policy above which the stage alerts ``kl_blowup`` (needs ``beta`` > 0)."""
    min_entropy: float = Field(0.05, ge=0)
    """Token entropy below which the stage alerts ``entropy``: generations are collapsing."""
    flat_reward_tolerance: float = Field(0.01, ge=0)
    """Fitted reward change over ``window`` reward steps at or below which the stage alerts
    ``flat_reward``."""
    max_invalid_rewards: float = Field(0.5, ge=0, le=1)
    """Fraction of one reward's scores in a logged step that may be NaN/None (any is an alert);
    above it the stage fails: a reward that mostly cannot score gives GRPO nothing to learn from."""
    hacking_window: int = Field(3, ge=2)
    """In-training evaluations (``eval_every``) the reward-hacking check fits its trends over."""
    hacking_reward_rise: float = Field(0.05, ge=0)
    """Fitted rise of the mean ``reward`` across those evaluations above which, while accuracy
    falls, the stage alerts ``reward_hacking`` (in reward units: the weighted sum)."""
    hacking_accuracy_drop: float = Field(0.05, ge=0)
    """Fitted fall of ``eval/accuracy`` (a fraction) across those evaluations that counts as falling."""


class StageDataFilter(StrictModel):
    """Which prepared examples a GRPO stage trains on: a range of arithmetic operations per problem
    (``ops``: the synthetic generator's count, GSM8K's calculator annotations), then the first N."""

    min_ops: int | None = Field(None, ge=1)
    """Fewest arithmetic operations of a problem the stage trains on."""
    max_ops: int | None = Field(None, ge=1)
    """Most arithmetic operations of a problem the stage trains on."""
    limit: int | None = Field(None, ge=1)
    """Train on the first N examples left after the operations filter; null: all."""
    renamed_keys: ClassVar[dict[str, tuple[str, str]]] = {**_OPS_RENAMES, "num_examples": _LIMIT}
    cache_names: ClassVar[dict[str, str]] = {"limit": "num_examples"}


class PassRateConfig(StrictModel):
    """How a GRPO stage chooses its prompts by how often its input model solves them (its
    ``score-<stage>`` step, see posttrain.evaluation.pass_rate): a group of completions that all
    succeed or all fail carries no gradient, so prompts the model always or never solves are
    dropped before the stage spends rollouts on them."""

    omit_when_default: ClassVar[tuple[str, ...]] = ("refresh_every", "refresh_size")
    samples: int = Field(8, ge=2)
    """Completions sampled per candidate prompt (k), at the stage's temperature, completion length
    and tools; a prompt's pass rate is the share of them the ``correctness`` reward pays."""
    candidates: int | None = Field(256, ge=1)
    """Prompts scored: the first N of the stage's data (after ``data_filter``); null: all of it."""
    band: tuple[float, float] = (0.0, 1.0)
    """Open interval of pass rates kept: ``[0, 1]`` keeps what the model sometimes solves and
    sometimes does not; ``[0.1, 0.9]`` also drops the nearly always and nearly never solved."""
    weighting: Literal["uniform", "variance"] = "uniform"
    """``variance``: the kept prompts are drawn (with replacement, seeded) in proportion to
    p(1-p), the reward variance of a prompt solved with probability p, which peaks at one half:
    the prompts whose groups most likely differ come round most often."""
    refresh_every: int | None = Field(None, ge=1)
    """Keep the pool fresh while the stage trains: every N steps, ``refresh_size`` prompts are
    scored again (k completions each, by the policy as it is then). Pool prompts whose pass rate
    has left the band leave the stage; candidates of the stage's data outside the pool whose pass
    rate is inside it join, and stand in for prompts that left (and resample rounds draw them
    first). Needs ``zero_signal: drop`` or ``resample``; on several processes, each holding the whole
    policy (DDP, not FSDP or ZeRO-3). Null: the pool is what the scoring step chose."""
    refresh_size: int = Field(32, ge=2)
    """Prompts scored per refresh: up to half of them the pool's, least recently scored first; the
    rest candidates from outside the pool, in a seeded order that comes round again."""

    @model_validator(mode="after")
    def _band_in_order(self) -> PassRateConfig:
        low, high = self.band
        if not 0.0 <= low < high <= 1.0:
            raise ValueError(f"band: [{low}, {high}] is not 0 <= low < high <= 1")
        return self

    def keeps(self, rate: float) -> bool:
        """Whether a prompt with pass rate ``rate`` trains (strictly inside the band).

        >>> PassRateConfig().keeps(0.0), PassRateConfig().keeps(0.5), PassRateConfig().keeps(1.0)
        (False, True, False)
        """
        low, high = self.band
        return low < rate < high


class RFTConfig(StrictModel):
    """Train a stage by rejection-sampling fine-tuning (RFT) instead of GRPO: SFT on the correct
    completions its input model wrote in the stage's pass-rate scoring, mixed with replayed worked
    solutions of the run's training records. GRPO needs groups whose completions differ; RFT learns
    from every correct one, and where a model first meets a kind of question (answers known, no
    worked solutions) it moved accuracy far more than GRPO did in the same minutes
    (docs/results/2026-12-06-stage-own-prompts.md)."""

    replay: float = Field(1.0, ge=0)
    """Worked solutions of the run's training records (``data``'s train split, in its order) mixed in
    per correct completion, so the stage keeps what SFT taught: 0 trains on the completions alone."""
    trainer: dict[str, Any] = Field(default_factory=dict)
    """TRL ``SFTConfig`` options of the fine-tuning, passed through (``max_steps``, ``learning_rate``,
    ``per_device_train_batch_size``, ``max_length``, ...; posttrain's SFT defaults otherwise). The
    stage's own ``trainer:`` still sets how the scoring samples (temperature, completion length)."""

    @field_validator("trainer")
    @classmethod
    def _check_trainer(cls, value: dict[str, Any]) -> dict[str, Any]:
        return validate_trainer_options("sft", value)

    def trainer_options(self) -> dict[str, Any]:
        """posttrain's SFT defaults overlaid with these options."""
        return {**TRAINER_DEFAULTS["sft"], **self.trainer}


_GRPO_ONLY_FOR_RFT = {
    "zero_signal": "keep",
    "zero_signal_retire_after": None,
    "tool_protocol": "inline",
}
"""GRPO stage settings an ``rft:`` stage has no use for, with the value it accepts."""


class GRPOStageConfig(_StageWithTrainer, _ToolFields):
    trl_kind: ClassVar[str] = "grpo"
    omit_when_default: ClassVar[tuple[str, ...]] = (
        *_ToolFields.omit_when_default,
        *_SELECTION_KEYS,
        "pass_rate",
        "zero_signal_retire_after",
        "data",
        "rft",
    )
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")
    """Lowercase and unique: the stage's step is ``grpo-<name>``, or ``rft-<name>`` with ``rft:``
    (``--force``, runs, store folders)."""
    rewards: list[RewardSpec] = Field(min_length=1)
    """The rewards the stage is paid with, by name, with weights (see ``posttrain rewards list``)."""
    data: StageDataSource | None = None
    """Where the stage's prompts come from instead of the run's training records: a source of its
    own (``source``, ``path``, ``hub_id``, ``hub_config``, ``split``, ``synthetic``, ``limit`` as in
    ``data``), e.g. questions that have answers but no worked solutions, which GRPO's correctness
    reward needs and SFT cannot use. The data step prepares it as it does ``data`` (``data``'s seed,
    system prompt, prompt-length limit and bad-record rule), holds nothing out of it but its own
    ``selection_size`` slice, and removes every question that overlaps an evaluation set, the
    held-out slice or the selection slice. ``data_filter`` and ``pass_rate`` then choose among its
    records. Null: the run's training records."""
    data_filter: StageDataFilter = StageDataFilter()
    """Which prepared examples the stage trains on (a curriculum by operations per problem)."""
    monitor: MonitorConfig = MonitorConfig()
    """Thresholds of the health monitor's alerts for this stage."""
    sample_every: int = Field(5, ge=1)
    """Keep sample completions with per-reward scores every N steps."""
    zero_signal: Literal["keep", "drop", "resample"] = "keep"
    """Prompt groups whose completions all earned the same reward (no gradient): keep them (TRL's
    behaviour), drop them from the loss, or resample: replace them with fresh prompts' groups that
    have signal (DAPO's dynamic sampling), dropping what is still flat after the budget. See
    posttrain.training.zero_signal."""
    zero_signal_max_rounds: int = Field(4, ge=1)
    """resample: extra generation rounds per generation batch at most (each at most the batch's size)."""
    zero_signal_retire_after: int | None = Field(None, ge=1)
    """drop or resample: retire a prompt from the stage once this many of its groups in a row
    scored alike: it is not generated for again, and a fresh prompt of the stage's data (one not
    retired) stands in for it in every batch that would have held it. Null: prompts never leave."""
    eval_every: int | None = Field(None, ge=1)
    """Evaluate greedily on the selection slice (the stage's own ``data.selection_size``, else the
    run's ``data.selection_size``, else the held-out slice) at the start and every N steps (``eval/accuracy``, ``eval/accuracy_flexible``, ``eval/format`` next
    to the reward; what ``keep: best`` chooses by); null: no in-training evaluation."""
    eval_limit: int = Field(64, ge=1)
    """Questions per in-training evaluation, from the slice ``eval_every`` reads (those in the
    stage's ``data_filter`` ops range)."""
    pass_rate: PassRateConfig | None = None
    """Choose the stage's prompts by the input model's measured pass rate (a ``score-<stage>`` step
    before the stage); null: the stage trains on its whole ``data_filter`` slice."""
    rft: RFTConfig | None = None
    """Train the stage by rejection-sampling fine-tuning instead of GRPO (its step is then
    ``rft-<name>``): SFT on the distinct completions of its ``pass_rate`` scoring that the
    ``correctness`` reward pays in full, every scored prompt's, with replayed worked solutions.
    Needs ``pass_rate:``, whose ``samples`` and ``candidates`` then say how much is sampled (its
    ``band``, ``weighting`` and ``refresh_every`` choose GRPO's prompts and must stay unset). The
    stage's ``lora``, ``tools``, ``eval_every`` and ``keep`` apply to the fine-tuning, and of its
    ``trainer:`` only ``temperature`` and ``max_completion_length`` (the scoring's sampling, the
    in-training evaluation's length); ``rewards`` must be ``correctness`` alone (the scoring's
    reward decides); ``monitor`` and ``sample_every`` do not apply and stay out of its key.
    ``zero_signal``, chat tools and ``chat_template_kwargs`` are refused. Null: GRPO."""
    tools: list[str] = Field(default_factory=list)
    """Tools the stage's rollouts (and its in-training evaluation) use. ``inline`` ``[calculator]``:
    after an arithmetic expression and ``=`` posttrain's engine writes the value's tokens, which are
    masked out of the loss and the token counts (TRL's ``env_mask``), so GRPO rewards setting a
    problem up right; generation then always goes through posttrain's engine (a bf16 or fp32 shadow
    of the policy). ``chat``: passed to ``GRPOTrainer(tools=...)``, and TRL generates."""

    @property
    def step_name(self) -> str:
        """The stage's step name in the plan, runs and store: ``grpo-<name>`` (``rft-<name>`` with ``rft:``)."""
        return f"{self.method}-{self.name}"

    @property
    def method(self) -> Literal["grpo", "rft"]:
        """How the stage trains: ``grpo``, or ``rft`` when it sets ``rft:``."""
        return "grpo" if self.rft is None else "rft"

    def rft_section(self) -> SFTStageConfig:
        """The SFT an ``rft:`` stage runs: ``rft.trainer``, and the stage's tools, ``lora``,
        in-training evaluation and checkpoint choice."""
        assert self.rft is not None, "only an rft: stage fine-tunes"
        own = {
            k: getattr(self, k)
            for k in ("lora", "keep", "select_metric", "patience")
            if k in self.model_fields_set
        }
        return SFTStageConfig(
            trainer=self.rft.trainer,
            tools=list(self.tools),
            eval_every=self.eval_every,
            eval_limit=self.eval_limit,
            **own,
        )

    @model_validator(mode="after")
    def _own_selection_is_read(self) -> GRPOStageConfig:
        if self.data is not None and self.data.selection_size and self.eval_every is None:
            raise ValueError(
                "data.selection_size: only the stage's in-training evaluations read its selection slice; "
                "set eval_every, or remove it"
            )
        return self

    @model_validator(mode="after")
    def _rft_needs_its_scoring(self) -> GRPOStageConfig:
        if self.rft is None:
            return self
        if self.pass_rate is None:
            raise ValueError("rft: fine-tunes on the completions of the stage's scoring; it needs pass_rate:")
        defaults = PassRateConfig()
        for key in ("band", "weighting", "refresh_every"):
            if getattr(self.pass_rate, key) != getattr(defaults, key):
                raise ValueError(
                    f"pass_rate.{key}: chooses GRPO's prompts; an rft: stage trains on every scored prompt's "
                    "correct completions"
                )
        for key, accepted in _GRPO_ONLY_FOR_RFT.items():
            if getattr(self, key) != accepted:
                raise ValueError(
                    f"{key}: is a GRPO setting; an rft: stage takes {accepted!r} (or leave it out)"
                )
        unpaid = [spec.name for spec in self.rewards if spec.name != "correctness"]
        if unpaid:
            # the scoring's correctness alone decides what it trains on: any other would do nothing
            raise ValueError(
                f"rewards: an rft: stage trains on what the correctness reward pays; list only correctness "
                f"(got {', '.join(unpaid)})"
            )
        if "chat_template_kwargs" in self.trainer_options():
            # the scoring would render prompts with them and the fine-tuning without (SFTConfig has none)
            raise ValueError(
                "trainer.chat_template_kwargs: an rft: stage fine-tunes on the template's defaults"
            )
        try:
            self.rft_section()  # the SFT's own options, checked as SFT's (selection included)
        except ValidationError as exc:  # said of the SFT section this stage builds: name rft's key
            first = exc.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            message = str(first["msg"]).removeprefix("Value error, ")
            raise ValueError(f"rft.{where}: {message}" if where else f"rft.{message}") from None
        return self

    @model_validator(mode="after")
    def _tools_need_the_engine(self) -> GRPOStageConfig:
        inline = self.tools and self.tool_protocol == "inline"
        blockers = generation_blockers(self.trainer_options()) if inline else []
        if blockers:
            raise ValueError(
                f"tools: {', '.join(self.tools)} runs in posttrain's generation engine, and these trainer "
                f"options leave generation to TRL or vLLM: {', '.join(blockers)}"
            )
        return self

    @model_validator(mode="after")
    def _pass_rate_samples_as_the_stage(self) -> GRPOStageConfig:
        # The scoring step samples with posttrain's engine (temperature only); a pass rate measured
        # under other sampling would choose prompts for a policy the stage does not run.
        unlike = [b for b in generation_blockers(self.trainer_options()) if b != "use_vllm"]
        if self.zero_signal_retire_after is not None and self.zero_signal == "keep":
            raise ValueError("zero_signal_retire_after: needs zero_signal: drop or resample")
        if self.refreshes_pool() and self.zero_signal == "keep":
            raise ValueError("pass_rate.refresh_every: needs zero_signal: drop or resample")
        if self.pass_rate is not None and unlike:
            raise ValueError(
                f"pass_rate: scoring samples at the stage's temperature alone, and these trainer options "
                f"sample otherwise: {', '.join(unlike)}"
            )
        return self

    def uses_vllm_server(self) -> bool:
        """True when the stage generates through a vLLM server (TRL's ``use_vllm`` + ``vllm_mode: server``)."""
        options = self.trainer_options()
        # an rft: stage samples in its scoring step, through posttrain's engine
        return self.rft is None and bool(options.get("use_vllm")) and options.get("vllm_mode") == "server"

    def refreshes_pool(self) -> bool:
        """True when the stage re-scores its prompt pool while it trains (``pass_rate.refresh_every``)."""
        return self.pass_rate is not None and self.pass_rate.refresh_every is not None


def _unique(names: list[str], what: str) -> None:
    """Refuse repeated names (their outputs, metrics and runs are named after them)."""
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"{what} must be unique; repeated: {', '.join(dupes)}")


class _StageDefaultsKeys(StrictModel):
    renamed_keys: ClassVar[dict[str, tuple[str, str]]] = GRPOStageConfig.renamed_keys

    @model_validator(mode="before")
    @classmethod
    def _no_name(cls, value: Any) -> Any:
        if isinstance(value, dict) and "name" in value:
            raise _KeyProblem("name", "each stage names itself; defaults hold what stages share")
        return value


_StageDefaults = create_model(
    "_StageDefaults",
    __base__=_StageDefaultsKeys,
    **{name: (Any, None) for name in GRPOStageConfig.model_fields if name != "name"},
)
"""The keys ``grpo.defaults`` may hold: a GRPO stage's, but ``name`` (values are checked once merged)."""


class GRPOSection(StrictModel):
    defaults: dict[str, Any] = Field(default_factory=dict, exclude=True)
    """Keys every stage gets unless it sets them itself (any stage key but ``name``). Mappings of
    options (``trainer``, ``monitor``, ``data_filter``, ``launch``) merge key by key under the
    stage's own; lists (``rewards``, ``tools``) and ``lora`` are replaced whole. The resolved stages
    are what runs, is logged and is hashed: moving a key into the defaults changes no cache key."""
    stages: list[GRPOStageConfig] = Field(default_factory=list)
    """Ordered GRPO stages; each starts from the previous stage's output."""
    _inherited: tuple[frozenset[str], ...] = PrivateAttr(default=())

    @field_validator("defaults", mode="before")
    @classmethod
    def _stage_keys_only(cls, defaults: Any) -> Any:
        if isinstance(defaults, dict):
            _StageDefaults.model_validate(defaults)  # unknown and renamed keys, located under defaults
        return defaults

    @field_validator("stages", mode="before")
    @classmethod
    def _merge_defaults(cls, stages: Any, info: ValidationInfo) -> Any:
        defaults = info.data.get("defaults")
        if not defaults or not isinstance(stages, list):
            return stages
        return [merge_stage(defaults, stage) if isinstance(stage, dict) else stage for stage in stages]

    @field_validator("stages")
    @classmethod
    def _unique_names(cls, stages: list[GRPOStageConfig]) -> list[GRPOStageConfig]:
        _unique([s.name for s in stages], "GRPO stage names")
        return stages

    @model_validator(mode="wrap")
    @classmethod
    def _remember_inherited(cls, value: Any, handler: Any) -> GRPOSection:
        section = handler(value)
        if isinstance(value, dict) and isinstance(value.get("defaults"), dict):
            stages = value.get("stages") or []
            section._inherited = tuple(
                inherited_keys(value["defaults"], s if isinstance(s, dict) else {}) for s in stages
            )
        return section

    def __eq__(self, other: object) -> bool:
        """The stages are what the section is; the defaults are how they were written (a launched
        child rebuilds the resolved stages without them and must equal its parent)."""
        return isinstance(other, GRPOSection) and self.stages == other.stages

    def written_key(self, index: int, path: str) -> str:
        """``grpo.stages.<index>.<path>``, or ``grpo.defaults.<path>`` when the stage took it from there."""
        inherited = self._inherited[index] if index < len(self._inherited) else frozenset()
        if from_defaults(inherited, path.split(".")):
            return f"grpo.defaults.{path}"
        return f"grpo.stages.{index}.{path}"


class _EvalSource(StrictModel):
    """Where one evaluation set's questions come from (the primary set's and each extra set's)."""

    omit_when_default: ClassVar[tuple[str, ...]] = ("themes",)

    data: Literal["heldout", "hub", "local", "synthetic"] = "heldout"
    """heldout: the validation slice of `data`; hub: GSM8K test; local: `path`; synthetic: generated."""
    path: str | None = None
    """``local``: a GSM8K-format .jsonl file or folder."""
    hub_split: str = "test"
    """``hub``: the GSM8K split evaluated on."""
    limit: int | None = Field(100, ge=1)
    """The first N questions in the source's fixed order (synthetic: N generated), so numbers compare."""
    min_ops: int | None = Field(None, ge=1)
    """synthetic only: fewest arithmetic operations per generated problem (default 1)."""
    max_ops: int | None = Field(None, ge=1)
    """synthetic only: most arithmetic operations per generated problem (default 4)."""
    numbers: Literal["default", "small"] | None = None
    """synthetic only: size of the quantities (default ``default``; ``small``: below 120)."""
    themes: list[SyntheticTheme] | None = Field(None, min_length=1)
    """synthetic only: the stories questions come from (default all; see ``data.synthetic.themes``)."""

    @model_validator(mode="after")
    def _source_consistent(self) -> _EvalSource:
        if self.data == "local" and not self.path:
            raise ValueError("data: local needs `path`")
        # A key its source never reads would otherwise change nothing, silently (a test file's
        # path set on the wrong extra set is the usual slip).
        if self.path is not None and self.data != "local":
            raise ValueError(f"`path` applies to data: local only (data is {self.data})")
        if self.hub_split != "test" and self.data != "hub":  # a written-out config holds the default
            raise ValueError(f"`hub_split` applies to data: hub only (data is {self.data})")
        if (
            self.data != "synthetic"
            and (self.min_ops, self.max_ops, self.numbers, self.themes) != (None,) * 4
        ):
            raise ValueError(
                f"min_ops/max_ops/numbers/themes apply to data: synthetic only (data is {self.data})"
            )
        if self.min_ops is not None and self.max_ops is not None and self.min_ops > self.max_ops:
            raise ValueError(f"min_ops ({self.min_ops}) > max_ops ({self.max_ops})")
        return self

    def synthetic_ops(self) -> tuple[int, int]:
        """(fewest, most) operations of generated problems; (1, 4) unless narrowed."""
        low = self.min_ops or 1
        return low, self.max_ops or max(low, 4)


# A set's name becomes a folder in the store and part of metric names (`accuracy_strict/<name>`), so
# it is kept to what both take; `ops_<n>` is what per-difficulty metrics use.
_SET_NAME = re.compile(r"^[a-z][a-z0-9_-]{0,39}$")


class EvalSetConfig(_EvalSource):
    """One more evaluation set, evaluated by the same step as the primary set (``eval.extra_sets``)."""

    omit_when_default: ClassVar[tuple[str, ...]] = (*_EvalSource.omit_when_default, "tools", "final_only")

    name: str
    """Names the set's report folder (`<set>/report.json`) and its metrics (`accuracy_strict/<set>`)."""
    data: Literal["heldout", "hub", "local", "synthetic"]  # required: an extra set names its source
    """Where the set's questions come from, as ``eval.data`` (required: an extra set names its source)."""
    renamed_keys: ClassVar[dict[str, tuple[str, str]]] = {"max_new_tokens": _COMPLETION_LENGTH}
    cache_names: ClassVar[dict[str, str]] = {"max_completion_length": "max_new_tokens"}
    max_completion_length: int | None = Field(None, ge=1)
    """Token limit of each completion for this set (default: ``eval.max_completion_length``)."""
    tools: list[str] | None = None
    """Tools for this set, in ``eval.tool_protocol`` (default: ``eval.tools``); ``[]`` evaluates
    without any, e.g. beside a calculator-assisted primary set, so the two accuracies sit side by side."""
    final_only: bool = False
    """Evaluate only the final model (the last stage's evaluation, or the baseline's when nothing
    trains): a large set, such as GSM8K's test split, reported once instead of after every stage."""

    @field_validator("name")
    @classmethod
    def _safe_name(cls, name: str) -> str:
        if not _SET_NAME.fullmatch(name) or is_ops_slice(name):
            raise ValueError(
                f"set name {name!r} must be 1-40 lowercase letters, digits, '_' or '-', starting with a "
                "letter, and not ops_<n> (it names a folder and metrics)"
            )
        return name


class EvalConfig(_EvalSource, _ToolFields):
    omit_when_default: ClassVar[tuple[str, ...]] = (
        *_EvalSource.omit_when_default,
        *_ToolFields.omit_when_default,
    )
    renamed_keys: ClassVar[dict[str, tuple[str, str]]] = {"max_new_tokens": _COMPLETION_LENGTH}
    cache_names: ClassVar[dict[str, str]] = {"max_completion_length": "max_new_tokens"}
    max_completion_length: int = Field(256, ge=1)
    """Token limit of each completion; a completion that reaches it counts as truncated."""
    batch_size: int = Field(64, ge=1)
    """Rows decoded together: more rows share each decode step's weight reads, up to where the
    step's cost grows with the rows (docs/results/2026-12-01-decode-experiments.md)."""
    backend: Literal["hf", "vllm", "vllm_server"] = "hf"
    """How completions are generated: ``hf`` (posttrain's continuous-batching engine on the model
    in memory; CPU or GPU), ``vllm`` (an offline vLLM engine in the evaluation's own process; CUDA +
    vLLM) or ``vllm_server`` (the managed ``vllm serve`` of the ``vllm_server:`` section, which
    is then required, started for each evaluation step on the evaluated model and stopped after;
    CUDA + vLLM). All three use the same sampling settings and the same scoring."""
    pass_k: int = Field(1, ge=1)
    """Samples per question; above 1, reports pass@k (and needs ``temperature`` > 0)."""
    temperature: float = Field(0.0, ge=0)
    """0 = greedy; pass@k > 1 needs temperature > 0."""
    seed: int = Field(0, ge=0, lt=SEED_LIMIT)
    """The evaluation's sampling seed (``temperature`` > 0 only; each sample's seed derives from it
    and the question): fixed, not the run's; see the top-level ``seed``."""
    baseline: bool = True
    """Evaluate the input model before any training stage."""
    after_each_stage: bool = True
    """Evaluate after every training stage; false: after the last only."""
    extra_sets: list[EvalSetConfig] = Field(default_factory=list)
    """More evaluation sets, each with its own report and metrics (`accuracy_strict/<name>`); the
    fields above (the primary set) keep their metric names."""
    tools: list[str] = Field(default_factory=list)
    """Tools completions are generated with (posttrain's engine, ``backend: hf``), in
    ``tool_protocol``. Reports name the tools and count calls; a tool-assisted accuracy is never
    compared silently with a bare one (``eval --diff``)."""

    @model_validator(mode="after")
    def _consistent(self) -> EvalConfig:
        if self.pass_k > 1 and self.temperature == 0:
            raise ValueError("pass_k > 1 needs sampling: set temperature > 0")
        if self.seed != 0 and self.temperature == 0:
            raise ValueError(
                f"seed {self.seed} draws nothing at temperature 0 (greedy): set temperature > 0 or leave seed out"
            )
        for extra in self.extra_sets:
            if extra.tools:
                _check_tool_names(extra.tools, self.tool_protocol, None)
        with_tools = [name or "eval" for name, s in self.all_sets() if s.uses_tools()]
        if with_tools and self.backend != "hf":
            raise ValueError(
                f"tools run in posttrain's engine (backend: hf); backend {self.backend} cannot force "
                f"tokens into a completion (sets with tools: {', '.join(with_tools)})"
            )
        return self

    @field_validator("extra_sets")
    @classmethod
    def _unique_set_names(cls, sets: list[EvalSetConfig]) -> list[EvalSetConfig]:
        _unique([s.name for s in sets], "extra set names")
        return sets

    def for_model(self, *, final: bool) -> EvalConfig:
        """The sets one evaluation step evaluates: without the ``final_only`` ones unless it
        evaluates the final model."""
        if final:
            return self
        return self.model_copy(update={"extra_sets": [s for s in self.extra_sets if not s.final_only]})

    def all_sets(self) -> list[tuple[str | None, EvalConfig]]:
        """(name, settings) of every evaluation set: the primary (name None) first, then each extra set."""
        primary = self.model_copy(update={"extra_sets": []})
        return [(None, primary), *((s.name, self.set_config(s)) for s in self.extra_sets)]

    def set_config(self, extra: EvalSetConfig) -> EvalConfig:
        """This config with ``extra``'s source (and generation limit) in place of the primary's: what
        one extra set is evaluated with (generation settings shared, no further sets)."""
        update: dict[str, Any] = {f: getattr(extra, f) for f in _EvalSource.model_fields}
        update["max_completion_length"] = extra.max_completion_length or self.max_completion_length
        update["tools"] = self.tools if extra.tools is None else extra.tools
        update["extra_sets"] = []
        return self.model_copy(update=update)


class TrackingConfig(StrictModel):
    enabled: bool = True
    """Log runs, models and evaluations to MLflow; false: nothing is logged."""
    experiment: str | None = None
    """Defaults to $MLFLOW_EXPERIMENT_NAME (or $MLFLOW_EXPERIMENT_ID), else the config's `name`."""
    tracking_uri: str | None = None
    """Defaults to $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working directory."""
    log_model: bool = True
    """The final stage's LoggedModel holds its weights (an MLflow transformers model); every other
    stage's LoggedModel is a reference (tags + stage.json)."""
    system_metrics: bool = True
    """Stage runs log CPU/RAM/disk/network/GPU metrics (MLflow's ``log_system_metrics``); the sampling
    interval is MLflow's ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL`` (default 10 s)."""


class OrchestrationConfig(StrictModel):
    store: str = ".posttrain"
    """Stage outputs, cache records and the embedded Prefect home live here."""
    cache: bool = True
    """Serve unchanged steps from the store; false: every step runs again."""
    shared_store: str | None = None
    """An fsspec URL (``file:///mnt/shared/posttrain``, ``s3://bucket/posttrain``) where finished step
    outputs are shared between workers: pulled into ``store`` when missing, pushed when finished
    (:mod:`posttrain.cache.shared`)."""
    concurrent_evals: bool = False
    """The Prefect flow runs each evaluation in a worker process (Prefect's process pool) and trains
    the next stage meanwhile; an evaluation's record and MLflow run are written once it ends, and the
    flow waits for them all before it ends. Off by default: on one device an evaluation beside a training stage
    only slows both; set ``gpu_slots`` to queue them for the device instead. Changes no cache key."""
    gpu_slots: int | None = Field(default=None, ge=1)
    """At most this many posttrain steps run at once on this Prefect server: every training and
    evaluation task carries the tag ``gpu``, and the flow sets Prefect's tag concurrency limit
    ``gpu`` to this value as it starts (``prefect concurrency-limit create gpu N`` does the same by
    hand). The limit holds across flow runs, sweep points and workers sharing the server; null
    leaves whatever limit the server has."""


class PipelineConfig(StrictModel):
    """One whole run. Counts follow one rule: ``limit`` keeps the first N of something in a fixed
    order (null: all); ``*_size`` is a slice set aside from the training records (``eval_size``,
    ``selection_size``); ``num_*`` is how many posttrain generates or draws
    (``data.synthetic.num_examples``, ``dpo.num_prompts``, ``dpo.num_generations``). Completion
    length is TRL's ``max_completion_length`` everywhere. A key renamed to follow them (``training``,
    ``num_examples`` of ``sft`` and ``data_filter``, ``samples_per_prompt``, ``max_new_tokens``,
    ``data.synthetic.seed``) fails with "renamed to" and its new name."""

    renamed_keys: ClassVar[dict[str, tuple[str, str]]] = _LAUNCH_RENAMED
    cache_names: ClassVar[dict[str, str]] = {"launch": "training"}
    derived_defaults: ClassVar[dict[str, str]] = {"name": "the config file's stem"}
    """Defaults the loader fills in before validation, as the config reference words them."""
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    """Run name: names the MLflow experiment unless
    ``tracking.experiment`` is set, and the registered model ``compare --promote`` writes."""
    seed: int = Field(0, ge=0, lt=SEED_LIMIT)
    """The run's seed, and the one a seed sweep varies (``posttrain sweep --seeds 0,1,2``). Every
    training stage draws from it: TRL's ``seed`` (LoRA initialisation, data order, dropout, GRPO's
    sampled completions), DPO's prompts and samples, and the fresh prompts of ``zero_signal:
    resample``; a stage's ``trainer:`` refuses ``seed`` and ``data_seed``. Two steps have a seed of
    their own instead, fixed (0) unless set, so that runs over several seeds answer the same
    questions and share one data step and one baseline evaluation. ``data.seed`` draws the held-out
    slice, the selection slice and the synthetic problems (it replaces ``data.synthetic.seed``);
    setting it changes the questions every evaluation asks. ``eval.seed`` draws an evaluation's
    samples when ``eval.temperature`` > 0 (a greedy evaluation draws nothing and refuses it); every
    model of a run is sampled with the same draws, which keeps paired comparisons tight. Synthetic
    evaluation sets (``eval.data: synthetic``) have a fixed seed of their own, so their problems are
    never the training problems."""
    model: ModelConfig
    """The model the pipeline starts from, and how every stage loads and trains it."""
    data: DataConfig = DataConfig()
    """Where training questions come from and how they become prompts, held-out and selection slices."""
    sft: SFTStageConfig | None = None
    """Supervised fine-tuning on worked solutions (TRL's ``SFTTrainer``); null: no SFT stage."""
    dpo: DPOStageConfig | None = None
    """DPO on on-policy preference pairs (TRL's ``DPOTrainer``); null: no DPO stage."""
    grpo: GRPOSection = GRPOSection()
    """GRPO stages (TRL's ``GRPOTrainer``), run in order after SFT and DPO."""
    eval: EvalConfig = EvalConfig()
    """GSM8K-style evaluation before training and after each stage."""
    tracking: TrackingConfig = TrackingConfig()
    """MLflow tracking: experiment, tracking store, what is logged."""
    orchestration: OrchestrationConfig = OrchestrationConfig()
    """Where outputs and cache records live, and how steps share a machine or a cluster."""
    launch: LaunchConfig = LaunchConfig()
    """How training stages are started: in the pipeline's process, or under ``accelerate launch``."""
    vllm_server: VLLMServerConfig | None = None
    """A managed vLLM server for GRPO stages in ``vllm_mode: server``; null: none (a stage in server
    mode then connects to a server you run, at its own ``vllm_server_host``/``port``)."""

    @model_validator(mode="after")
    def _stage_lora_fits_model(self) -> PipelineConfig:
        """ModelConfig's own rule, for a stage's ``lora: null``. (Under ``adapter_policy: adapter`` a
        full stage saves the whole model, as full fine-tuning always does: see save_policy.)"""
        for key, section in self.stage_sections():
            full = "lora" in section.model_fields_set and section.lora is None
            if full and self.model.quantization == "4bit":
                where = self.written_key(key, "lora")
                raise ValueError(f"{where}: null (full fine-tuning) cannot train a 4bit model (QLoRA)")
        return self

    @model_validator(mode="after")
    def _best_needs_a_selection_slice(self) -> PipelineConfig:
        for key, section in self.stage_sections():
            own = getattr(section, "data", None)
            if own is not None and own.selection_size:
                continue  # a GRPO stage with a selection slice of its own chooses by that one
            if section.keep == "best" and self.data.selection_size == 0:
                also = ", or the stage's own data.selection_size" if key.startswith("grpo.") else ""
                raise ValueError(
                    f"{self.written_key(key, 'keep')}: best needs data.selection_size (training records set "
                    "aside to choose the checkpoint on; choosing on the evaluation set would overstate the "
                    f"gain){also}"
                )
        return self

    @model_validator(mode="after")
    def _own_slice_of_other_records(self) -> PipelineConfig:
        def records(source: DataSource) -> dict[str, Any]:  # which records: a limit only shortens them
            return {name: getattr(source, name) for name in DataSource.model_fields if name != "limit"}

        for i, stage in enumerate(self.grpo.stages):
            if stage.data is None or not stage.data.selection_size:
                continue
            if records(stage.data) == records(self.data):
                raise ValueError(
                    f"{self.grpo.written_key(i, 'data.selection_size')}: the stage's source is the run's data, "
                    "whose records are held out or trained on; set data.selection_size for a slice of them"
                )
        return self

    def written_key(self, section_key: str, path: str) -> str:
        """The dotted key of ``path`` in a stage section (``sft``, ``grpo.stages.1``) as the file has
        it: a key a GRPO stage took from ``grpo.defaults`` is named there. For checks made after
        validation, so that an error in a default names the default."""
        prefix = "grpo.stages."
        if section_key.startswith(prefix) and section_key[len(prefix) :].isdigit():
            return self.grpo.written_key(int(section_key[len(prefix) :]), path)
        return f"{section_key}.{path}"

    def stage_sections(self) -> list[tuple[str, _StageWithTrainer]]:
        """``(config key, section)`` of every training stage in the file (``sft``, ``grpo.stages.1``)."""
        sections: list[tuple[str, _StageWithTrainer]] = []
        if self.sft is not None:
            sections.append(("sft", self.sft))
        if self.dpo is not None:
            sections.append(("dpo", self.dpo))
        sections += [(f"grpo.stages.{i}", s) for i, s in enumerate(self.grpo.stages)]
        return sections

    def model_for(self, section: Any) -> ModelConfig:
        """The model settings one training stage runs with: its own ``lora:`` when it sets one
        (e.g. a full SFT for the format, then LoRA for GRPO), else ``model``'s."""
        if "lora" not in getattr(section, "model_fields_set", ()):
            return self.model
        return self.model.model_copy(update={"lora": section.lora})

    def launch_of(self, section: Any) -> LaunchConfig:
        """The resolved ``launch:`` settings of one stage section (its override over the global)."""
        return self.launch.merged(getattr(section, "launch", None))

    def stages(self) -> list[tuple[str, str]]:
        """``(kind, step name)`` of each enabled training stage, in execution order."""
        stages = []
        if self.sft is not None and self.sft.enabled:
            stages.append(("sft", self.sft.step_name))
        if self.dpo is not None and self.dpo.enabled:
            stages.append(("dpo", self.dpo.step_name))
        stages += [(s.method, s.step_name) for s in self.grpo.stages]
        return stages

    def stage_data_sources(self) -> dict[str, DataConfig]:
        """Step name -> data settings of each GRPO stage with a ``data:`` source of its own."""
        return {s.step_name: self.data.source_of(s) for s in self.grpo.stages if s.data is not None}

    def stage_names(self) -> list[str]:
        """Training stages' step names in execution order (`sft`, `dpo`, `grpo-<name>`)."""
        return [name for _, name in self.stages()]


# --------------------------------------------------------------------------- loading


def apply_override(raw: dict[str, Any], override: str) -> None:
    """Apply one ``dotted.key=value`` override in place; list indices are numbers (``stages.1.x``)."""
    key, sep, text = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {override!r} is not of the form dotted.key=value")
    value = _parse_override_value(text, f"override {key.strip()}")
    parts = key.strip().split(".")
    node: Any = raw
    for depth, part in enumerate(parts):
        last = depth == len(parts) - 1
        where = ".".join(parts[: depth + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(f"override {key}: '{where}' is not an index of a list of {len(node)}")
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        elif isinstance(node, dict):
            if last:
                node[part] = value
            else:
                if node.get(part) is None:  # absent, or an explicit `null` section being filled in
                    node[part] = {}
                node = node[part]
        else:
            raise ConfigError(f"override {key}: '{'.'.join(parts[:depth])}' is a value, not a section")


def _parse_override_value(text: str, source: str = "override") -> Any:
    """A YAML scalar (`1e-5`, `null`, `true`) or flow collection (`[a, b]`); other text stays a string.

    Without the fallback, `--set data.system_prompt=Be brief: answer` would become a mapping.
    """
    if not text.strip():
        return None
    try:
        value = load_yaml_bounded(text, source)
    except YAMLLimitError:
        raise
    except ConfigError:
        return text
    if isinstance(value, dict | list) and not text.lstrip().startswith(("[", "{")):
        return text
    return value


def format_validation_error(exc: ValidationError, source: str, raw: Any = None) -> str:
    """One line: ``source: dotted.key: problem`` for the first error (``(+N more)`` if there are more).
    With the config mapping as written (``raw``), a key a GRPO stage took from ``grpo.defaults`` is
    named there."""
    err = exc.errors()[0]
    loc: tuple[str | int, ...] = tuple(err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if isinstance(problem := (err.get("ctx") or {}).get("error"), _KeyProblem):
        loc, msg = (*loc, problem.key), problem.problem  # a section's check about one of its keys
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    elif not err["type"].startswith("bool"):
        msg += yaml_boolean_hint(err.get("input"))
    if raw is not None:
        loc = written_location(loc, msg, raw)
    where = ".".join(str(p) for p in loc)
    more = f" (+{len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    if not where and _KEYED_MESSAGE.match(msg):  # a check across sections names its key itself
        return f"{source}: {msg}{more}"
    return f"{source}: {where or '(top level)'}: {msg}{more}"


_KEYED_MESSAGE = re.compile(r"^[a-z_]+(\.[a-z0-9_]+)*: ")


def parse_config(raw: dict[str, Any], source: str = "<config>") -> PipelineConfig:
    """A config mapping checked against the schema (TRL options included, reward names not): the
    schema step of :func:`posttrain.pipeline.load_config`, which loads a config for a run."""
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source, raw)) from None


def read_config_mapping(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The config file as a mapping with overrides applied, not yet validated (the first step of
    :func:`posttrain.pipeline.load_config`)."""
    path = Path(path)
    if path.exists() and (problem := path_problem(path, "file")):
        raise ConfigError(f"{path}: cannot read config: it {problem}")  # a FIFO would block forever
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}): save it as UTF-8"
        ) from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    raw = load_yaml_bounded(text, str(path), _UniqueKeyLoader)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a config must be a YAML mapping")
    raw.setdefault("name", path.stem)
    for override in overrides:
        apply_override(raw, override)
    check_config_values(raw, str(path))
    return raw


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.safe_load`` that refuses a key repeated in one mapping (YAML would keep the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, str | int | float | bool) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {seen[key]})", key_node.start_mark
                )
            if isinstance(key, str | int | float | bool):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def dump_config(cfg: PipelineConfig) -> str:
    """The resolved config as YAML (what ran, logged next to every run)."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
