"""Checks of what a config points at and how big it asks things to be, made by validation
(:mod:`posttrain.pipeline.validation`) before any store is created, lock taken or model loaded.

* **The model**: a built-in, a local folder holding ``config.json``, a local ``.gguf`` file, or a
  hub id of the form ``org/name``; a URL (``https://``, ``file://``) is none of these and is refused
  instead of being looked up as a hub id. The model's context length is read where it is known
  (built-ins, a local folder's ``config.json``), and every generation limit must fit in it.
* **Numbers**: counts beyond what any run could use (10^12 synthetic examples, a batch of 10^5) are
  refused with the key, as TRL's options are in :mod:`posttrain.core.trainer_options`; names that
  become folder names are kept short enough for any file system.
* **Tracking URI**: a form MLflow can use (``http(s)://host``, ``sqlite:///path``, a database URL
  with a host, ``file:``, ``databricks``); whether it answers is checked by ``run`` before the store
  is locked (``posttrain.tracking.tracking_problem``).
* **Local data**: every line of a local data or evaluation file is read now, so a malformed line
  is ``file:line`` before a store or an MLflow run exists (``on_bad_record: skip`` only counts them).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from posttrain.core.config import PipelineConfig
from posttrain.core.errors import ConfigError, DataError
from posttrain.core.inputs import path_problem
from posttrain.core.redact import redact_text
from posttrain.core.untrusted import UntrustedContentError, read_json_bounded
from posttrain.data.pass_rates import MAX_SAMPLES
from posttrain.data.sources import load_jsonl
from posttrain.models.resolve import BUILTIN_MODELS

__all__ = [
    "BOUNDS",
    "check_bounds",
    "check_generation_lengths",
    "check_local_data",
    "check_model",
    "check_tracking_uri",
    "local_data_files",
]

_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}(/[A-Za-z0-9][A-Za-z0-9._-]{0,95})?")
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def check_model(cfg: PipelineConfig, source: str) -> int | None:
    """``model.name`` names a model that can be loaded; returns its context length where known."""
    name, key = cfg.model.name, f"{source}: model.name"
    cache_dir = cfg.model.cache_dir
    if cache_dir and (problem := path_problem(cache_dir, "folder")) and Path(cache_dir).expanduser().exists():
        raise ConfigError(f"{source}: model.cache_dir: {cache_dir} {problem}")
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name].context
    if "://" in name or name.lower().startswith("file:"):
        raise ConfigError(
            f"{key}: {redact_text(name)} is a URL, not a model: give a hub id (org/name), a local model "
            f"folder, a .gguf file or a built-in ({', '.join(BUILTIN_MODELS)})"
        )
    path = Path(name).expanduser()
    if path.suffix == ".gguf" or name.startswith((".", "/", "~")) or os.path.lexists(path):
        want = "file" if path.suffix == ".gguf" else "folder"
        if (problem := path_problem(path, want)) is not None:
            raise ConfigError(f"{key}: {name} {problem}" if path.exists() else f"{key}: {name}: {problem}")
        if want == "folder":
            return _folder_context(path, key)
        return None
    if not _HUB_ID.fullmatch(name) or ".." in name:
        raise ConfigError(
            f"{key}: {name!r} is not a hub id (org/name), a local model folder, a .gguf file or a "
            f"built-in ({', '.join(BUILTIN_MODELS)})"
        )
    return None


def _folder_context(path: Path, key: str) -> int | None:
    config = path / "config.json"
    if path_problem(config, "file") is not None:
        raise ConfigError(f"{key}: {path} is not a Hugging Face model folder (no config.json)")
    try:
        info = read_json_bounded(config, max_bytes=4 << 20, expect=dict)
    except (OSError, UntrustedContentError) as exc:
        raise ConfigError(f"{key}: {exc}") from None
    text_config = info.get("text_config") if isinstance(info.get("text_config"), dict) else {}
    for source in (info, text_config):
        for name in _CONTEXT_KEYS:
            if isinstance(source.get(name), int) and source[name] > 0:
                return source[name]
    return None


def _generation_limits(cfg: PipelineConfig) -> Iterator[tuple[str, int]]:
    """(key, tokens) of every limit that must fit in the model's context."""
    yield "data.max_prompt_tokens", cfg.data.max_prompt_tokens
    yield "eval.max_completion_length", cfg.eval.max_completion_length
    for i, extra in enumerate(cfg.eval.extra_sets):
        if extra.max_completion_length is not None:
            yield f"eval.extra_sets.{i}.max_completion_length", extra.max_completion_length
    if cfg.dpo is not None:
        yield "dpo.max_completion_length", cfg.dpo.max_completion_length
    for where, section in cfg.stage_sections():
        options = section.trainer_options()
        for option in ("max_completion_length", "max_length"):
            if isinstance(options.get(option), int):
                yield cfg.written_key(where, f"trainer.{option}"), options[option]
        rft = getattr(section, "rft", None)  # an rft: stage's fine-tuning has limits of its own
        length = rft.trainer_options().get("max_length") if rft is not None else None
        if isinstance(length, int):
            yield cfg.written_key(where, "rft.trainer.max_length"), length


def check_generation_lengths(cfg: PipelineConfig, context: int | None, source: str) -> None:
    """Every prompt and generation limit fits in the model's ``context`` (when it is known)."""
    if context is None:
        return
    for key, tokens in _generation_limits(cfg):
        if tokens > context:
            raise ConfigError(
                f"{source}: {key}: {tokens} tokens is beyond the context of {cfg.model.name} ({context} tokens)"
            )


_COUNT = 10_000_000
_BATCH = 65_536
BOUNDS: tuple[tuple[str, int], ...] = (
    ("data.synthetic.num_examples", _COUNT),
    ("data.limit", _COUNT),
    ("data.eval_size", _COUNT),
    ("eval.limit", _COUNT),
    ("eval.batch_size", _BATCH),
    ("eval.pass_k", 1024),
    ("sft.limit", _COUNT),
    ("dpo.num_prompts", _COUNT),
    ("dpo.num_generations", 1024),
    ("dpo.max_completion_length", 1 << 20),
    ("eval.max_completion_length", 1 << 20),
    ("launch.num_processes", 4096),
)
"""(attribute path, largest value) of the counts no run can use more of; GRPO stages and extra
evaluation sets are checked by :func:`check_bounds` too. The longest name is :data:`_NAME_LENGTH`."""
_NAME_LENGTH = 64


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part, None)
        if cfg is None:
            return None
    return cfg


def check_bounds(cfg: PipelineConfig, source: str) -> None:
    """No count beyond :data:`BOUNDS`, no name longer than the file system can take in a folder name."""
    values = [(key, _get(cfg, key), most) for key, most in BOUNDS]
    for i, stage in enumerate(cfg.grpo.stages):
        values += [
            (cfg.written_key(f"grpo.stages.{i}", "data_filter.limit"), stage.data_filter.limit, _COUNT),
            (cfg.written_key(f"grpo.stages.{i}", "eval_limit"), stage.eval_limit, _COUNT),
            (
                cfg.written_key(f"grpo.stages.{i}", "zero_signal_max_rounds"),
                stage.zero_signal_max_rounds,
                1024,
            ),
        ]
        if stage.data is not None:
            values += [
                (cfg.written_key(f"grpo.stages.{i}", "data.limit"), stage.data.limit, _COUNT),
                (
                    cfg.written_key(f"grpo.stages.{i}", "data.selection_size"),
                    stage.data.selection_size,
                    _COUNT,
                ),
                (
                    cfg.written_key(f"grpo.stages.{i}", "data.synthetic.num_examples"),
                    stage.data.synthetic.num_examples,
                    _COUNT,
                ),
            ]
        if stage.pass_rate is not None:
            values += [
                (
                    cfg.written_key(f"grpo.stages.{i}", "pass_rate.samples"),
                    stage.pass_rate.samples,
                    MAX_SAMPLES,
                ),
                (
                    cfg.written_key(f"grpo.stages.{i}", "pass_rate.candidates"),
                    stage.pass_rate.candidates,
                    _COUNT,
                ),
                (
                    cfg.written_key(f"grpo.stages.{i}", "pass_rate.refresh_size"),
                    stage.pass_rate.refresh_size,
                    _COUNT,
                ),
            ]
    for i, extra in enumerate(cfg.eval.extra_sets):
        values.append((f"eval.extra_sets.{i}.limit", extra.limit, _COUNT))
    for key, value, most in values:
        if isinstance(value, int) and value > most:
            raise ConfigError(f"{source}: {key}: {value} is more than posttrain can use (at most {most:,})")
    names = [("name", cfg.name)] + [(f"grpo.stages.{i}.name", s.name) for i, s in enumerate(cfg.grpo.stages)]
    for key, name in names:
        if len(name) > _NAME_LENGTH:
            raise ConfigError(
                f"{source}: {key}: {len(name)} characters; at most {_NAME_LENGTH} (it names folders and runs)"
            )


_TRACKING_SCHEMES = {
    "http",
    "https",
    "sqlite",
    "postgresql",
    "mysql",
    "mssql",
    "file",
    "databricks",
    "databricks-uc",
    "uc",
}
_NEEDS_HOST = {"http", "https", "postgresql", "mysql", "mssql"}


def tracking_uri_problem(uri: str) -> str | None:
    """Why MLflow could not use ``uri`` as a tracking URI, judged by its form alone (None: it can).

    >>> tracking_uri_problem("sqlite:///m.db"), tracking_uri_problem("mlruns"), tracking_uri_problem("ftp://h/x")
    (None, None, 'ftp is not a tracking store MLflow knows (http, https, sqlite, postgresql, mysql, mssql, file, databricks)')
    """
    try:
        parts = urlsplit(uri)
        _ = parts.port
    except ValueError:  # the parser's own message may quote part of a password
        return "not a URI (its host or port cannot be read; percent-encode '@', ':' and '/' in a password)"
    if not parts.scheme or (len(parts.scheme) == 1 and re.match(r"[A-Za-z]:", uri)):
        return None  # a local folder (MLflow's file store)
    scheme = parts.scheme.split("+", 1)[0].lower()
    if scheme not in _TRACKING_SCHEMES:
        known = "http, https, sqlite, postgresql, mysql, mssql, file, databricks"
        return f"{scheme} is not a tracking store MLflow knows ({known})"
    if scheme in _NEEDS_HOST and not parts.hostname:
        return f"{scheme} needs a host ({scheme}://host:port/...)"
    if scheme == "sqlite" and not uri.startswith("sqlite:///") and uri != "sqlite://":
        return "a SQLite URI is sqlite:///relative/path.db or sqlite:////absolute/path.db"
    return None


def check_tracking_uri(cfg: PipelineConfig, source: str) -> None:
    """The tracking URI (``tracking.tracking_uri``, else ``$MLFLOW_TRACKING_URI``) has a usable form."""
    if not cfg.tracking.enabled:
        return
    uri = cfg.tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if uri and (problem := tracking_uri_problem(uri)):
        key = (
            "tracking.tracking_uri"
            if cfg.tracking.tracking_uri
            else f"MLFLOW_TRACKING_URI={redact_text(uri)}"
        )
        raise ConfigError(f"{source}: {key}: {problem}")


def local_data_files(cfg: PipelineConfig) -> list[tuple[str, str, Any]]:
    """(key, path, section) of every local file a run reads: training data, each GRPO stage's own
    ``data:`` source (read with the run's ``data`` settings) and each evaluation set."""
    found: list[tuple[str, str, Any]] = []
    if cfg.data.source == "local" and cfg.data.path:
        found.append(("data.path", cfg.data.path, cfg.data))
    for i, stage in enumerate(cfg.grpo.stages):
        if stage.data is not None and stage.data.source == "local" and stage.data.path:
            key = cfg.written_key(f"grpo.stages.{i}", "data.path")
            found.append((key, stage.data.path, cfg.data.source_of(stage)))
    if cfg.eval.data == "local" and cfg.eval.path:
        found.append(("eval.path", cfg.eval.path, cfg.eval))
    for i, extra in enumerate(cfg.eval.extra_sets):
        if extra.data == "local" and extra.path:
            found.append((f"eval.extra_sets.{i}.path", extra.path, extra))
    return found


def check_local_data(cfg: PipelineConfig, source: str = "<config>") -> None:
    """Every line a run would read from a local data or evaluation file parses as a GSM8K record,
    and each file yields at least one: an empty file, or one whose every line is bad (with
    ``on_bad_record: skip``), is an error naming its key now, not after the store and MLflow run
    exist. A malformed line is ``file:line: problem`` (``on_bad_record: error``)."""
    for key, path, section in local_data_files(cfg):
        on_bad = getattr(section, "on_bad_record", "error")
        try:
            loaded = load_jsonl(path, on_bad, limit=section.limit)
        except DataError as exc:
            raise ConfigError(f"{source}: {key}: {exc}") from None
        own = getattr(section, "selection_size", 0) if key.startswith("grpo.") else 0
        if loaded.records and own >= len(loaded.records):
            where = key.removesuffix(".path") + ".selection_size"
            raise ConfigError(
                f"{source}: {where}: {own} of the {len(loaded.records)} records of {path} leaves none to train on"
            )
        if loaded.records:
            continue
        if loaded.skipped:
            where, line_no, reason = loaded.skipped[0]
            why = f"all {len(loaded.skipped)} skipped as bad; the first: {where}:{line_no}: {reason}"
        else:
            why = "it holds no records"
        raise ConfigError(f"{source}: {key}: {path}: no usable GSM8K records ({why})")
