"""What a training stage leaves on disk, and how the next stage (or the evaluator) reads it back.

A stage output directory holds a loadable policy plus ``stage.json``::

    <stage dir>/
        model.safetensors, config.json, ...   merge policy / full fine-tuning: a standalone model
        adapter_model.safetensors, ...        adapter policy: only the LoRA adapter
        tokenizer files
        stage.json                            what produced it (below)
        log_history.jsonl                     every logged trainer step
        completions/*.parquet                 GRPO samples with per-reward scores (when logged)
        dpo_pairs.jsonl                       DPO: the on-policy pairs trained on
        train_data.jsonl                      rft: the prompt/completion rows it fine-tuned on

``stage.json`` (schema 1): ``stage``, ``kind`` (sft/dpo/grpo/rft), ``config`` and ``config_hash`` (the
stage section, :func:`posttrain.core.hashing.stable_hash`), ``model_config_hash``, ``trainer_options`` and
``trainer_options_hash`` (what reached TRL, defaults included), ``input_model`` {path, fingerprint},
``data_fingerprint``, ``seed``, ``precision``, ``artifact`` (merged/full/adapter), ``adapter``
{base, base_fingerprint, root} or null, ``metrics``, ``alerts``, ``samples``, ``duration_s``,
``created``, ``versions`` (posttrain, torch, transformers, trl, peft, accelerate, datasets).

Directories are written atomically (:mod:`posttrain.core.atomic`): a stage trains into
``<dir>.tmp-<random>`` next to the final path and renames it at the very end, so a crash or a kill
never leaves a directory that looks complete. ``stage.json`` is written last inside the temporary directory, which makes
:func:`is_complete_stage` a reliable test.

An adapter directory records in ``stage.json`` the model it was trained on (``adapter.base``), which
may itself be an adapter directory: :func:`posttrain.models.loading.load_stage_model` follows that chain, merging each
adapter into the weights below it, so a two-stage GRPO run in adapter mode costs two small adapters
on disk and loads like any other model.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from posttrain.cache.digests import sha256_file
from posttrain.core.errors import StageError
from posttrain.core.hashing import jsonable, package_versions
from posttrain.core.redact import redact
from posttrain.core.untrusted import (
    UntrustedContentError,
    note_unreadable,
    read_json_bounded,
    read_jsonl_bounded,
)
from posttrain.models.datasets_compat import dataset_fingerprint
from posttrain.models.resolve import resolve_model_path

logger = logging.getLogger(__name__)

STAGE_FILE = "stage.json"
LOG_HISTORY_FILE = "log_history.jsonl"
TRAIN_DATA_FILE = "train_data.jsonl"
ADAPTER_CONFIG = "adapter_config.json"
SCHEMA_VERSION = 1
# Files that describe a run rather than the policy: two runs producing the same weights fingerprint equal.
_NOT_POLICY = {
    STAGE_FILE,
    LOG_HISTORY_FILE,
    TRAIN_DATA_FILE,
    "dpo_pairs.jsonl",
    "dpo_pairs_stats.json",
    "README.md",
    "training_args.bin",
}
_NOT_POLICY_DIRS = ("completions", "checkpoint-", "runs")


# --------------------------------------------------------------------------- fingerprints


def _policy_files(root: Path) -> list[Path]:
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if not path.is_file() or rel.name in _NOT_POLICY or rel.name.startswith("."):
            continue
        if any(str(rel).startswith(prefix) for prefix in _NOT_POLICY_DIRS):
            continue
        files.append(path)
    return files


def fingerprint_dir(path: str | Path) -> str:
    """A content hash of the policy in a model or stage directory (16 hex characters).

    Hashes every file's relative name, size and sha256 (streamed: ~1 s per 500 MB), skipping run
    records (``stage.json``, logs, sample completions, checkpoints) so the value changes exactly when
    what a later stage loads changes. For an adapter directory the recorded fingerprint of its base
    is mixed in, because the same adapter on another base is another model.
    """
    root = Path(path)
    if not root.is_dir():
        raise StageError(f"cannot fingerprint {root}: not a directory")
    digest = hashlib.sha256()
    for file in _policy_files(root):
        digest.update(f"{file.relative_to(root).as_posix()}\0{file.stat().st_size}\0".encode())
        digest.update(sha256_file(file).encode())
    info = read_stage_json(root) if (root / STAGE_FILE).exists() else {}
    base = (info.get("adapter") or {}).get("base_fingerprint")
    if base:
        digest.update(f"adapter-base\0{base}".encode())
    return digest.hexdigest()[:16]


def fingerprint_model(
    name_or_path: str, cache_dir: str | Path | None = None, revision: str | None = None
) -> str:
    """Fingerprint of a stage input: a directory's content, a built-in's converted files, or a hub id."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return fingerprint_dir(path)
    resolved = resolve_model_path(name_or_path, cache_dir)
    if Path(resolved).is_dir():
        return fingerprint_dir(resolved)
    return hashlib.sha256(f"hub:{resolved}@{revision or 'main'}".encode()).hexdigest()[:16]


def fingerprint_dataset(dataset: Any) -> str:
    """The datasets library's own fingerprint (it tracks every transform), else a hash of the rows."""
    fp = dataset_fingerprint(dataset)
    if fp:
        return fp
    blob = json.dumps(list(dataset), sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# --------------------------------------------------------------------------- stage.json


def write_stage_json(
    directory: Path,
    *,
    stage: str,
    kind: str,
    config: Mapping[str, Any],
    config_hash: str,
    model_config_hash: str,
    input_model: str,
    input_fingerprint: str,
    data_fingerprint: str,
    seed: int,
    precision: str,
    metrics: Mapping[str, Any],
    alerts: list[Mapping[str, Any]],
    samples: list[str],
    artifact: str,
    adapter: Mapping[str, Any] | None,
    duration_s: float,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Write ``stage.json``: everything needed to tell what produced this policy and to reload it
    (secrets in the config or trainer options redacted)."""
    info = {
        "schema": SCHEMA_VERSION,
        "stage": stage,
        "kind": kind,
        "config_hash": config_hash,
        "model_config_hash": model_config_hash,
        "config": dict(config),
        "input_model": {"path": input_model, "fingerprint": input_fingerprint},
        "data_fingerprint": data_fingerprint,
        "seed": seed,
        "precision": precision,
        "artifact": artifact,
        "adapter": dict(adapter) if adapter else None,
        "metrics": dict(metrics),
        "alerts": list(alerts),
        "samples": list(samples),
        "duration_s": round(duration_s, 3),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "versions": package_versions(),
        **(dict(extra) if extra else {}),
    }
    info = jsonable(redact(info))
    (directory / STAGE_FILE).write_text(json.dumps(info, indent=2, sort_keys=False))
    return info


def read_stage_json(directory: str | Path) -> dict[str, Any]:
    """``stage.json`` of a stage output, read as untrusted store content: bounded, a JSON object,
    ``adapter`` an object or null; else a StageError naming the file."""
    path = Path(directory) / STAGE_FILE
    try:
        info = read_json_bounded(path, max_bytes=64 << 20, expect=dict)
    except FileNotFoundError:
        raise StageError(f"{directory} is not a posttrain stage output (no {STAGE_FILE})") from None
    except UntrustedContentError as exc:
        raise StageError(f"{exc} (a damaged {STAGE_FILE})") from None
    adapter = info.get("adapter")
    if adapter is not None and not (isinstance(adapter, dict) and isinstance(adapter.get("base", ""), str)):
        raise StageError(f"{path}: adapter must be an object naming its base (a damaged {STAGE_FILE})")
    return info


def is_complete_stage(directory: str | Path) -> bool:
    """True when ``directory`` holds a finished stage (stage.json is written last, then renamed)."""
    directory = Path(directory)
    if not (directory / STAGE_FILE).is_file():
        return False
    return (directory / "config.json").is_file() or (directory / ADAPTER_CONFIG).is_file()


def write_log_history(directory: Path, log_history: list[Mapping[str, Any]]) -> None:
    with (directory / LOG_HISTORY_FILE).open("w") as fh:
        for row in log_history:
            fh.write(json.dumps(jsonable(row)) + "\n")


def read_log_history(directory: str | Path) -> list[dict[str, Any]]:
    """The trainer's log history a stage output keeps (rank 0's, when several processes trained)."""
    text = (Path(directory) / LOG_HISTORY_FILE).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def write_train_data(directory: Path, rows: Any) -> None:
    """Keep the rows a stage trained on (``TRAIN_DATA_FILE``, one JSON object per line) where
    they cannot be rebuilt from the data step alone: an ``rft:`` stage's mix of the model's own
    completions and replayed solutions."""
    with (directory / TRAIN_DATA_FILE).open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(jsonable(dict(row))) + "\n")


def read_train_data(directory: str | Path) -> Any:
    """The rows :func:`write_train_data` kept in a stage output, as a ``datasets.Dataset``, or None
    when it kept none. A damaged file (unreadable, not JSON objects, columns of mixed types) is
    noted and read as none: the stage's model, not this record, is the output."""
    import datasets  # heavy: deferred until needed

    path = Path(directory) / TRAIN_DATA_FILE
    if not path.is_file():
        return None
    unreadable = "not logging the stage's training data"
    try:
        rows = read_jsonl_bounded(path)
    except (OSError, UntrustedContentError) as exc:
        note_unreadable(exc, unreadable)
        return None
    if not all(isinstance(row, dict) for row in rows):
        note_unreadable(f"{path}: a line that is not a JSON object", unreadable)
        return None
    try:
        return datasets.Dataset.from_list(rows)
    except (TypeError, ValueError) as exc:  # pyarrow's ArrowInvalid / ArrowTypeError
        note_unreadable(f"{path}: {type(exc).__name__}: {str(exc)[:200]}", unreadable)
        return None


# --------------------------------------------------------------------------- saving and loading


def is_adapter_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and (Path(path) / ADAPTER_CONFIG).is_file()


def save_policy(model: Any, tokenizer: Any, directory: Path, *, adapter_policy: str) -> str:
    """Save the trained policy as ``adapter_policy`` says; returns the artifact kind written.

    ``merge`` folds LoRA into the weights (a standalone model any tool can load); ``adapter`` keeps
    only the adapter (megabytes instead of the model's size, but it needs its base to load).
    """
    from peft import PeftModel  # heavy: deferred until needed

    if isinstance(model, PeftModel):
        if adapter_policy == "adapter":
            model.save_pretrained(directory)
            artifact = "adapter"
        else:
            model.merge_and_unload().save_pretrained(directory)
            artifact = "merged"
    else:
        if adapter_policy == "adapter":
            logger.warning(
                "adapter_policy: adapter needs LoRA (model.lora); full fine-tuning saves the whole model"
            )
        model.save_pretrained(directory)
        artifact = "full"
    tokenizer.save_pretrained(directory)
    return artifact


def adapter_root(path: str | Path) -> str:
    """The full model at the bottom of an adapter chain (the path itself for a standalone model)."""
    seen = set()
    current = str(path)
    while is_adapter_dir(current):
        if current in seen:
            raise StageError(f"adapter chain loops at {current}")
        seen.add(current)
        base = (read_stage_json(current).get("adapter") or {}).get("base")
        if not base:
            raise StageError(
                f"{current} is an adapter without a recorded base (adapter.base in {STAGE_FILE})"
            )
        current = base
    return current
