"""MLflow plumbing shared by the pipeline run and the stage runs: URIs, params flattening, batched
logging through an explicit client, metric copies for cached stages, and the guard that keeps
transformers' MLflow callback from opening runs of its own."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import ssl
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from posttrain.core.config import PipelineConfig, TrackingConfig
from posttrain.core.net import tcp_unreachable, unreachable
from posttrain.core.redact import redact

logger = logging.getLogger(__name__)

DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
CACHE_KEY_TAG = "posttrain.cache_key"
ROLE_TAG = "posttrain.role"
STEP_TAG = "posttrain.stage"
"""The plan step a nested run records (``Step.name``)."""
STORE_TAG = "posttrain.store"
"""The store a pipeline run writes: its runs left RUNNING by a kill are closed by the next run there."""
PREFECT_FLOW_RUN_TAG = "posttrain.prefect_flow_run_id"
"""On a pipeline run that Prefect ran: the id of its flow run (the UI's /runs/flow-run/<id>)."""
STEP_KIND_TAG = "posttrain.step_kind"
"""Its kind (``Step.kind``: data, sft, dpo, grpo, rft, score, eval): what comparisons and plots select runs by."""
SEED_GROUP_TAG = "posttrain.seed_group"
"""On the pipeline run: the same for runs of one config that differ only in ``seed``
(:func:`posttrain.core.sweep.seed_group`), so MLflow's UI groups them and ``compare`` aggregates them."""
STEPS_TAG = "posttrain.steps"
"""On the pipeline run: the plan's step names in order, comma-separated (orders compare's columns)."""
# mlflow 3.17 limits (mlflow.utils.validation): longer values are rejected, not truncated.
MAX_PARAM_LENGTH = 6000
MAX_TAG_LENGTH = 8000
_PARAMS_PER_BATCH = 100
_METRICS_PER_BATCH = 1000
TRACKED_PACKAGES = ("posttrain", "torch", "transformers", "trl", "peft", "datasets", "prefect", "mlflow")
# Read by transformers' MLflowCallback: either would make it open (and close) a run of its own.
_CALLBACK_HIJACK_VARS = ("MLFLOW_RUN_ID", "MLFLOW_NESTED_RUN")
_BAD_KEY_CHARS = re.compile(r"[^\w\-. /:]")


# --------------------------------------------------------------------------- helpers


def resolve_tracking_uri(tracking: TrackingConfig) -> str:
    """``tracking.tracking_uri``, else ``$MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db``.

    A relative SQLite path is made absolute now, so a tracker handed to another process or thread
    with a different working directory still writes to the same database.
    """
    uri = tracking.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    db = sqlite_path(uri)
    if db is None or db.is_absolute():
        return uri
    query = uri.partition("?")[2]
    return f"sqlite:///{db.resolve()}" + (f"?{query}" if query else "")


_DATABASE_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}


def tracking_problem(tracking: TrackingConfig) -> str | None:
    """Why the tracking store cannot be used, found in seconds (MLflow itself retries for minutes).

    An http(s) server must answer, a database server (PostgreSQL, MySQL, SQL Server) accept a
    connection, and a SQLite database's folder must exist and the file, where it exists, be an
    SQLite database. None when all is well.
    """
    return uri_problem(resolve_tracking_uri(tracking))


_SQLITE_HEADER = b"SQLite format 3\x00"


def _mlflow_tls_context() -> ssl.SSLContext | None:
    """The TLS settings MLflow's client takes from the environment, so the check trusts a server
    exactly when MLflow would (a self-signed one with ``MLFLOW_TRACKING_INSECURE_TLS``, a private
    CA with ``MLFLOW_TRACKING_SERVER_CERT_PATH``, a client certificate)."""
    insecure = os.environ.get("MLFLOW_TRACKING_INSECURE_TLS", "").lower() in ("true", "1")
    server_ca = os.environ.get("MLFLOW_TRACKING_SERVER_CERT_PATH")
    client_cert = os.environ.get("MLFLOW_TRACKING_CLIENT_CERT_PATH")
    if not (insecure or server_ca or client_cert):
        return None
    context = ssl.create_default_context(cafile=server_ca or None)
    if insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if client_cert:
        context.load_cert_chain(client_cert)
    return context


def uri_problem(uri: str) -> str | None:
    """:func:`tracking_problem` for a resolved tracking URI: also how a run that fails to log tells
    a server that went away from a bug in what it logged. The message names the file or address at
    fault, not the URI: each caller names the URI as the user gave it (a key, a flag, a variable)."""
    if uri.startswith(("http://", "https://")):
        problem = unreachable(uri.rstrip("/") + "/health", context=_mlflow_tls_context())
        return f"MLflow tracking server unreachable: {problem}" if problem else None
    scheme = uri.split("://", 1)[0].split("+", 1)[0].lower() if "://" in uri else ""
    if scheme in _DATABASE_PORTS:
        parts = urlsplit(uri)
        problem = tcp_unreachable(parts.hostname or "", parts.port or _DATABASE_PORTS[scheme])
        return f"MLflow tracking database unreachable: {problem}" if problem else None
    db = sqlite_path(uri)
    if db is None:
        return None
    if not db.parent.is_dir():
        return f"folder {db.parent} does not exist"
    if db.exists() and not db.is_file():  # a folder: MLflow retries "unable to open" for minutes
        return f"{db} is not a file"
    if not _sqlite_or_empty(db):
        return f"{db} is not an SQLite database"
    return None


def _sqlite_or_empty(db: Path) -> bool:
    """Whether SQLite can open ``db`` as a database: missing, empty, or starting with its header."""
    try:
        with db.open("rb") as file:
            head = file.read(len(_SQLITE_HEADER))
    except FileNotFoundError:
        return True
    except OSError:
        return True  # unreadable here: SQLite's own error says why, in one line
    return head in (b"", _SQLITE_HEADER)


def experiment_name(cfg: PipelineConfig) -> str:
    """``tracking.experiment``, else ``$MLFLOW_EXPERIMENT_NAME``, else the config's name (runs of one
    config compare side by side)."""
    return cfg.tracking.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or cfg.name


def flatten_params(value: Any, prefix: str = "") -> dict[str, str]:
    """Dotted keys (list items by index, as ``--set`` uses) to MLflow-safe string values.

    Lists of scalars stay one JSON value (``["q_proj", "v_proj"]``) so a diff shows one key; values
    are truncated to MLflow's 6000-character limit, which would otherwise reject the whole batch.
    Secrets are redacted (:func:`posttrain.core.redact.redact`).
    """
    value = redact(value.model_dump(mode="json") if hasattr(value, "model_dump") else value)
    out: dict[str, str] = {}
    if isinstance(value, Mapping) and value:
        for key, item in value.items():
            out.update(flatten_params(item, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(value, list | tuple) and any(isinstance(v, Mapping) for v in value):
        for index, item in enumerate(value):
            out.update(flatten_params(item, f"{prefix}.{index}" if prefix else str(index)))
    else:
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        out[safe_key(prefix or "value")] = truncate(text, MAX_PARAM_LENGTH)
    return out


def safe_key(key: str) -> str:
    return _BAD_KEY_CHARS.sub("_", key)[:250]


def retry_dataset_race(call: Callable[[], Any]) -> Any:
    """``call()``, once more if it lost the race to create a dataset row.

    MLflow's SQL store gets or creates the dataset row (experiment, name, digest) in two statements,
    so two runs logging the same dataset at the same moment (a sweep's side-by-side points) make one
    fail on the unique constraint. The row exists then, and a second try links to it.
    """
    from mlflow.exceptions import MlflowException  # heavy: deferred until needed

    try:
        return call()
    except MlflowException as exc:
        text = str(exc).lower()
        if "datasets" not in text or not ("unique" in text or "duplicate" in text):
            raise
        logger.debug("dataset row created concurrently by another run; linking to it")
        return call()


def truncate(text: str, limit: int) -> str:
    marker = "...[truncated]"
    return text if len(text) <= limit else text[: limit - len(marker)] + marker


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI, without the query SQLAlchemy reads as options
    (``sqlite:///mlflow.db?timeout=30``).

    >>> sqlite_path("sqlite:///runs/mlflow.db?timeout=30"), sqlite_path("http://h")
    (PosixPath('runs/mlflow.db'), None)
    """
    return Path(uri[len("sqlite:///") :].split("?", 1)[0]) if uri.startswith("sqlite:///") else None


def _numeric(value: Any) -> float | None:
    """A loggable metric value, or None for text/None (bools count as 0/1)."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, bool | int | float):
        return float(value)
    return None


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def flush_async_logging() -> None:
    """Write out what transformers' MLflow callback queued (it logs asynchronously), as a stage's
    run closes. MLflow's flush shuts its logging thread pools down and starts new ones: a process
    trains one stage at a time, so no training logs through them meanwhile."""
    import mlflow  # heavy: deferred until needed

    mlflow.flush_async_logging()


def prompt_async_flush() -> None:
    """Make MLflow's async-logging flush return at once instead of after up to a second.

    transformers' MLflow callback logs with ``synchronous=False``. MLflow's logging thread then
    blocks in ``queue.get(timeout=1)`` and sees a stop request only when that returns, so every
    flush and every run end waits up to 1 s: 7-9 s over a ten-step pipeline. With a buffering
    period the thread waits on the stop event instead, which wakes it at once, and metrics go out
    in one batch per second. A value the user set is kept.
    """
    os.environ.setdefault("MLFLOW_ASYNC_LOGGING_BUFFERING_SECONDS", "1")


@contextlib.contextmanager
def global_tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's global tracking URI at ``uri`` for a block, then restore the previous one.

    For calls that read the global URI whatever client made them: the fluent ``mlflow.search_runs``,
    and the model registry resolving a ``models:/<id>`` source to its LoggedModel.
    """
    import mlflow  # heavy: deferred until needed

    previous = os.environ.get("MLFLOW_TRACKING_URI")  # set_tracking_uri exports it
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous)  # type: ignore[arg-type]


_OPENED: set[str] = set()
"""Tracking URIs this process has opened (MLflow caches the store behind each)."""


def mlflow_client(uri: str):
    from mlflow import MlflowClient  # heavy: deferred until needed

    if uri in _OPENED:
        return MlflowClient(tracking_uri=uri)
    with _first_open(uri):
        client = MlflowClient(tracking_uri=uri)
    _OPENED.add(uri)
    return client


@contextlib.contextmanager
def _first_open(uri: str) -> Iterator[None]:
    """Hold a lock on a SQLite database's folder while this process first opens it.

    The first client of a new SQLite database creates and migrates its tables. Two runs starting
    together on one new database (two stores sharing a tracking database) would both create them,
    and the second fails with ``table ... already exists``; with the lock the second waits a few
    seconds and finds the database ready. The folder is locked, not a file, so nothing is left
    beside the database.
    """
    db = sqlite_path(uri)
    if db is None or not db.parent.is_dir():
        yield
        return
    folder = os.open(db.parent, os.O_RDONLY)
    try:
        fcntl.flock(folder, fcntl.LOCK_EX)
        yield
    finally:
        os.close(folder)  # releases the lock


def metric_batch(metrics: Mapping[str, Any], step: int | None = None, stamp: int | None = None) -> list[Any]:
    from mlflow.entities import Metric  # heavy: deferred until needed

    stamp = stamp or int(time.time() * 1000)
    return [
        Metric(safe_key(k), v, stamp, step or 0)
        for k, raw in metrics.items()
        if (v := _numeric(raw)) is not None
    ]


def send_metric_batch(client: Any, run_id: str, batch: Sequence[Any]) -> None:
    for i in range(0, len(batch), _METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=list(batch[i : i + _METRICS_PER_BATCH]))


def send_metric_values(client: Any, run_id: str, metrics: Mapping[str, Any], step: int | None = None) -> None:
    send_metric_batch(client, run_id, metric_batch(metrics, step))


def send_params(client: Any, run_id: str, params: Mapping[str, str]) -> None:
    """Log only new keys: MLflow rejects re-logging a key with another value (same value is a no-op).

    The run's existing params are read back first, so this holds across processes too; a changed
    value is kept as a ``param_conflict.<key>`` tag instead of failing the pipeline.
    """
    from mlflow.entities import Param  # heavy: deferred until needed

    existing = client.get_run(run_id).data.params
    new = {k: v for k, v in params.items() if k not in existing}
    for key in sorted(k for k, v in params.items() if k in existing and existing[k] != v):
        logger.warning(
            "param %r already logged as %r; keeping it (new value %r as a tag)",
            key,
            existing[key],
            params[key],
        )
        client.set_tag(run_id, safe_key(f"param_conflict.{key}"), truncate(params[key], MAX_TAG_LENGTH))
    items = [Param(k, v) for k, v in new.items()]
    for i in range(0, len(items), _PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[i : i + _PARAMS_PER_BATCH])


def copy_metric_history(client: Any, source_run_id: str, target_run_id: str) -> dict[str, float]:
    """Copy every metric's full history (so reward curves of cached stages still plot)."""
    from mlflow.entities import Metric  # heavy: deferred until needed

    latest = client.get_run(source_run_id).data.metrics
    history = [m for key in latest for m in client.get_metric_history(source_run_id, key)]
    # Fresh entities: the originals carry the source run's id (and model/dataset links).
    send_metric_batch(client, target_run_id, [Metric(m.key, m.value, m.timestamp, m.step) for m in history])
    return dict(latest)


@contextlib.contextmanager
def callback_env_guard() -> Iterator[None]:
    saved = {name: os.environ.pop(name) for name in _CALLBACK_HIJACK_VARS if name in os.environ}
    if saved:  # the outer run (MLFLOW_RUN_ID) is the pipeline run's parent already
        logger.debug("hiding %s from the trainer's MLflow callback inside a stage", ", ".join(sorted(saved)))
    try:
        yield
    finally:
        os.environ.update(saved)


def mirror_eval(client: Any, parent_run_id: str | None, stage: str, metrics: Mapping[str, Any]) -> None:
    """Copy a stage's ``eval/<m>`` metrics to the parent as ``<stage>/<m>`` (one row per run in the UI)."""
    evals = {f"{stage}/{k[5:]}": v for k, v in metrics.items() if k.startswith("eval/")}
    if parent_run_id and evals:
        send_metric_values(client, parent_run_id, evals)
