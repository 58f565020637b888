"""Loading a config for a run: the schema (``posttrain.core.config``), then what only the layers
above the schema can check, the reward names and their params.

Everything that runs a config (the CLI, the flow's callers, tests) loads it here, so a config that
validates here is a config every step can build.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from posttrain.core.config import GRPOStageConfig, PipelineConfig, parse_config, read_config_mapping
from posttrain.core.errors import ConfigError
from posttrain.core.inputs import path_problem
from posttrain.core.library_policy import import_named
from posttrain.pipeline.input_checks import (
    check_bounds,
    check_generation_lengths,
    check_local_data,
    check_model,
    check_tracking_uri,
    local_data_files,
)
from posttrain.pipeline.launcher import accelerate_setup
from posttrain.rewards.registry import check_reward

__all__ = [
    "check_launchers",
    "check_paths",
    "check_rewards",
    "check_shared_store",
    "check_tools",
    "check_vllm_server",
    "load_config",
    "managed_vllm_stages",
]


def check_rewards(cfg: PipelineConfig, source: str = "<config>") -> None:
    """Every reward of every GRPO stage and of DPO resolves with its params; else one-line ConfigError.

    Nothing the config names is called (:func:`~posttrain.rewards.registry.check_reward`): a custom
    ``module:function`` is refused unless custom code is allowed from outside the config, and even
    then only its signature is read.
    """
    groups: list[tuple[str, Any]] = [(f"grpo.stages.{i}", s.rewards) for i, s in enumerate(cfg.grpo.stages)]
    if cfg.dpo is not None:
        groups.append(("dpo", cfg.dpo.rewards))
    for where, specs in groups:
        for j, spec in enumerate(specs):
            try:
                check_reward(spec.name, dict(spec.params))
            except ValueError as exc:
                raise ConfigError(f"{source}: {cfg.written_key(where, 'rewards')}.{j}: {exc}") from None


def check_paths(cfg: PipelineConfig, source: str = "<config>") -> None:
    """Local data and evaluation files exist (relative paths are read from the working directory),
    so a missing file is a config error now rather than a failed step after the server started."""
    for key, path, _ in local_data_files(cfg):
        problem = path_problem(path)
        if problem == "no such file or folder":
            raise ConfigError(f"{source}: {key}: no such file or folder: {path} (from {Path.cwd()})")
        if problem is not None:  # a FIFO or a device: reading it would hang or never end
            raise ConfigError(f"{source}: {key}: {path} {problem}")


def check_launchers(cfg: PipelineConfig, source: str = "<config>") -> None:
    """Every stage launched by accelerate names an accelerate config file that exists (relative to
    the working directory) with a usable ``num_processes``. Whether the machine has the GPUs it
    asks for is the stage's check when it starts: a GPU config validates on a laptop."""
    sections = [("sft", cfg.sft), ("dpo", cfg.dpo)]
    sections += [(f"grpo.stages.{i}", stage) for i, stage in enumerate(cfg.grpo.stages)]
    for where, section in sections:
        if section is None or not getattr(section, "enabled", True):
            continue
        launch = cfg.launch_of(section)
        if launch.launcher != "accelerate":
            continue
        own = section.launch is not None and section.launch.accelerate_config is not None
        key = cfg.written_key(where, "launch.accelerate_config") if own else "launch.accelerate_config"
        try:
            setup = accelerate_setup(launch, key)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from None
        if setup.shards and isinstance(section, GRPOStageConfig) and section.refreshes_pool():
            raise ConfigError(
                f"{source}: {cfg.written_key(where, 'pass_rate.refresh_every')}: the pool refresh "
                f"generates with the whole policy on each process "
                f"({setup.config_file} shards it: {setup.shards}); launch this stage with DDP "
                f"(configs/accelerate/ddp.yaml) or leave refresh_every unset"
            )


def check_shared_store(cfg: PipelineConfig, source: str = "<config>") -> None:
    """``orchestration.shared_store`` names a filesystem fsspec knows and can load (``s3://`` needs
    s3fs, ``gs://`` gcsfs, ...), so a typo fails now, not after the first stage trained."""
    url = cfg.orchestration.shared_store
    if not url:
        return
    import fsspec  # deferred: only configs with a shared store need it

    protocol = fsspec.core.split_protocol(url)[0] or "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as exc:
        raise ConfigError(f"{source}: orchestration.shared_store: {url}: {exc}") from None


_SERVER_KEYS = {"vllm_server_host": "host", "vllm_server_port": "port"}


def managed_vllm_stages(cfg: PipelineConfig) -> list[int]:
    """Indices of the GRPO stages whose vLLM server posttrain runs (``vllm_server:`` + server mode)."""
    if cfg.vllm_server is None:
        return []
    return [i for i, stage in enumerate(cfg.grpo.stages) if stage.uses_vllm_server()]


def check_vllm_server(cfg: PipelineConfig, source: str = "<config>") -> None:
    """With a managed ``vllm_server:``, a stage in TRL's server mode connects where posttrain starts
    the server: its own ``vllm_server_base_url``, or a host/port that differ, would point elsewhere.
    ``eval.backend: vllm_server`` needs the section (the server's settings)."""
    if cfg.eval.backend == "vllm_server" and cfg.vllm_server is None:
        raise ConfigError(
            f"{source}: eval.backend: vllm_server needs a vllm_server: section (the managed server's "
            "gpus, port, ...); add it or choose eval.backend: hf or vllm"
        )
    for i in managed_vllm_stages(cfg):
        options, stage = cfg.grpo.stages[i].trainer_options(), f"grpo.stages.{i}"
        if options.get("vllm_server_base_url") is not None:
            raise ConfigError(
                f"{source}: {cfg.written_key(stage, 'trainer.vllm_server_base_url')}: posttrain runs this stage's server (vllm_server:) and "
                "points the trainer at it; remove the option, or the vllm_server section to use your own server"
            )
        for key, field in _SERVER_KEYS.items():
            own = getattr(cfg.vllm_server, field, None)
            if key in options and options[key] != own:
                raise ConfigError(
                    f"{source}: {cfg.written_key(stage, f'trainer.{key}')}: {options[key]!r} conflicts with vllm_server.{field} ({own!r}), where "
                    "posttrain starts the server; remove the option"
                )


def _tool_sections(cfg: PipelineConfig) -> list[tuple[str, Any]]:
    return [*((f"grpo.stages.{i}", s) for i, s in enumerate(cfg.grpo.stages)), ("eval", cfg.eval)]


def check_tools(cfg: PipelineConfig, source: str = "<config>") -> None:
    """Tools resolve, and a model trained with TRL's chat tools is evaluated with them.

    A custom tool or environment factory is imported only with the custom-code opt-in, and only
    read (a tool's JSON schema is built from its signature and docstring, as TRL builds it). With
    ``tool_protocol: chat`` anywhere, the model's chat template must render tool calls (TRL's own
    ``supports_tool_calling``): its tokenizer is loaded for that check.
    """
    for where, section in _tool_sections(cfg):
        if section.tool_protocol != "chat":
            continue
        from transformers.utils import get_json_schema  # heavy: only configs with chat tools need it

        from posttrain.generation.tools import tool_functions

        for j, name in enumerate(section.tools):
            try:
                get_json_schema(tool_functions([name])[0])
            except (ValueError, TypeError, ImportError) as exc:  # transformers' schema errors are plain ones
                raise ConfigError(f"{source}: {cfg.written_key(where, 'tools')}.{j}: {exc}") from None
        if section.environment_factory is not None:
            try:
                factory = import_named(section.environment_factory, "environment factory")
            except ValueError as exc:
                raise ConfigError(
                    f"{source}: {cfg.written_key(where, 'environment_factory')}: {exc}"
                ) from None
            if not callable(factory):
                raise ConfigError(
                    f"{source}: {cfg.written_key(where, 'environment_factory')}: "
                    f"{section.environment_factory!r} is not callable"
                )
    for i, stage in enumerate(cfg.grpo.stages):
        if stage.tool_protocol != "chat" or not stage.uses_tools():
            continue
        evaluation = cfg.eval
        same = (
            evaluation.tool_protocol == "chat"
            and set(stage.tools) <= set(evaluation.tools)
            and stage.environment_factory == evaluation.environment_factory
        )
        if not same:
            wanted = f"eval.tools: {stage.tools}, eval.tool_protocol: chat"
            if stage.environment_factory:
                wanted += f", eval.environment_factory: {stage.environment_factory}"
            raise ConfigError(
                f"{source}: eval.tools: grpo.stages.{i} trains a tool user in TRL's chat protocol, and a trained "
                f"tool user is evaluated with its tools: set {wanted}"
            )
    if any(s.tool_protocol == "chat" and s.uses_tools() for _, s in _tool_sections(cfg)):
        _check_tool_template(cfg, source)


def _check_tool_template(cfg: PipelineConfig, source: str) -> None:
    """TRL's ``supports_tool_calling`` on the model's tokenizer, loaded without building or pulling a
    model: the built-in tiny model's tokenizer is built in memory, a pulled built-in, a local folder
    or a hub id's tokenizer is loaded. A built-in not pulled yet (or a .gguf file, converted at run
    time) is checked when the stage starts, by TRL itself."""
    from posttrain.core.errors import ModelError
    from posttrain.generation.tools import check_tool_template  # imports transformers
    from posttrain.models.loading import load_tokenizer
    from posttrain.models.resolve import models_cache_dir
    from posttrain.models.tiny import TINY_MODEL_NAME, build_tiny_tokenizer

    name = cfg.model.name
    try:
        if name == TINY_MODEL_NAME:
            tokenizer = build_tiny_tokenizer()
        elif (models_cache_dir(cfg.model.cache_dir) / name / "tokenizer_config.json").is_file():
            tokenizer = load_tokenizer(str(models_cache_dir(cfg.model.cache_dir) / name))
        elif name.endswith(".gguf") or "/" not in name and not Path(name).expanduser().is_dir():
            return
        else:
            tokenizer = load_tokenizer(name, revision=cfg.model.revision)
        check_tool_template(tokenizer)
    except ModelError as exc:
        raise ConfigError(f"{source}: model.name: {name}: {exc}") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{source}: model.name: {name}: cannot load its tokenizer to check tool calling: {exc}"
        ) from None


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> PipelineConfig:
    """The one way to load a pipeline config: the YAML file with ``--set`` style overrides applied,
    checked against the schema (:func:`~posttrain.core.config.parse_config`), the reward registry
    and the file system: what the model, the files and the URIs it names are, and that its numbers
    are sensible (:mod:`posttrain.pipeline.input_checks`). Nothing is written, no server is asked."""
    source = str(path)
    cfg = parse_config(read_config_mapping(path, overrides), source)
    check_bounds(cfg, source)
    check_rewards(cfg, source)
    check_tools(cfg, source)
    check_generation_lengths(cfg, check_model(cfg, source), source)
    check_paths(cfg, source)
    check_launchers(cfg, source)
    check_shared_store(cfg, source)
    check_vllm_server(cfg, source)
    check_tracking_uri(cfg, source)
    check_local_data(cfg, source)
    return cfg
