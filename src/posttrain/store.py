"""The run store: where stage outputs, cache records and the embedded Prefect home live.

Layout (default ``./.posttrain``, `orchestration.store`)::

    lock                      held by the running pipeline (one writer per store)
    data/<key>/               prepared train/eval datasets (datasets save_to_disk + stats.json)
    stages/<stage>-<key>/     model + tokenizer + stage.json, written atomically by the stage
    evals/<stage>-<key>/      report.json + examples.jsonl
    results/                  Prefect result storage: one record per cache key
    prefect/                  PREFECT_HOME of the embedded (ephemeral) Prefect API

A stage's cache key says exactly what its output depends on: the stage name, the hash of its
resolved config section, the fingerprints of its inputs (upstream model content, data) and the
posttrain version. Prefect's default policy includes the flow-run id (never reused across runs)
and its INPUTS policy hashes a path string, not the files behind it, so the key is built here.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import posttrain

logger = logging.getLogger(__name__)


# `stage_io.staging_dir` writes an output into `<name>.tmp-<hex>`, moves the previous output aside
# as `<name>.old-<hex>`, renames the new one into place and deletes the old one.
STAGING_SUFFIX = ".tmp-"
REPLACED_SUFFIX = ".old-"


class StoreLockedError(RuntimeError):
    """Another pipeline run holds this store."""


def cache_key(stage: str, config_hash: str, inputs: Mapping[str, str]) -> str:
    """sha256 over everything a stage's output depends on (24 hex characters)."""
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


@dataclass(frozen=True)
class Store:
    root: Path

    @classmethod
    def at(cls, path: str | Path) -> Store:
        root = Path(path).expanduser().resolve()
        root.mkdir(parents=True, exist_ok=True)
        return cls(root)

    def data_dir(self, key: str) -> Path:
        return self.root / "data" / key[:12]

    def stage_dir(self, stage: str, key: str) -> Path:
        return self.root / "stages" / f"{stage}-{key[:12]}"

    def eval_dir(self, stage: str, key: str) -> Path:
        return self.root / "evals" / f"{stage}-{key[:12]}"

    @property
    def results_dir(self) -> Path:
        return self.root / "results"

    @property
    def prefect_home(self) -> Path:
        return self.root / "prefect"

    def clean_interrupted_writes(self) -> list[Path]:
        """Tidy what a killed run left half-written; call it while holding :meth:`lock`.

        With the lock held no other run can be writing, so every ``.tmp-`` directory is the
        unfinished output of a run that died (SIGKILL, OOM, power loss) and is deleted. An ``.old-``
        directory is a complete previous output: it is put back when the run died between the two
        renames (its output is missing) and deleted otherwise. Returns what was deleted or restored.
        """
        touched = []
        for area in ("data", "stages", "evals"):
            folder = self.root / area
            if not folder.is_dir():
                continue
            for path in sorted(folder.iterdir()):
                name = path.name
                if STAGING_SUFFIX in name:
                    shutil.rmtree(path, ignore_errors=True)
                elif REPLACED_SUFFIX in name:
                    final = path.with_name(name.split(REPLACED_SUFFIX)[0])
                    if final.exists():
                        shutil.rmtree(path, ignore_errors=True)
                    else:
                        path.rename(final)
                        logger.warning("restored %s from an interrupted replacement", final)
                else:
                    continue
                touched.append(path)
        if touched:
            logger.warning(
                "cleaned %d leftover(s) of an interrupted run in %s: %s",
                len(touched),
                self.root,
                ", ".join(p.name for p in touched),
            )
        return touched

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the store's lock for a pipeline run; a second concurrent run fails at once.

        flock is released by the kernel when the process dies, so a SIGKILLed run never leaves a
        stale lock behind.
        """
        path = self.root / "lock"
        with path.open("a+") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                fh.seek(0)
                holder = fh.read().strip() or "unknown"
                raise StoreLockedError(
                    f"{self.root} is in use by another posttrain run (pid {holder})"
                ) from None
            fh.seek(0)
            fh.truncate()
            fh.write(str(os.getpid()))
            fh.flush()
            try:
                yield
            finally:
                fh.seek(0)
                fh.truncate()
                fcntl.flock(fh, fcntl.LOCK_UN)


def use_embedded_prefect(store: Store) -> bool:
    """Point Prefect at an ephemeral API whose home is inside the store, unless a server is configured.

    Must run before `prefect` is imported: Prefect reads its settings at import. With
    ``PREFECT_API_URL`` set, the real server is used and nothing is changed. Returns True when the
    embedded mode is in effect.
    """
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if os.environ.get("PREFECT_API_URL"):
        return False
    os.environ.setdefault("PREFECT_HOME", str(store.prefect_home))
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    return True


class EarlyPrefectServer:
    """Prefect's embedded API server, started in the background before the flow needs it.

    Prefect starts its ephemeral server (a uvicorn subprocess, 7-8 s on 2 cores) lazily, at the
    flow's first API call, after the config has been validated and torch/TRL imported. Starting it
    first lets the two overlap. ``SubprocessASGIServer`` is a per-process singleton, so the flow's
    client finds it running. Call :meth:`wait` before the flow starts, so it never sees a
    half-started server, or :meth:`cancel` when the run stops before its flow (a config error), so
    the error is not held up by the server's graceful shutdown.
    """

    def __init__(self) -> None:
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._start, name="prefect-server-start", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        try:
            from prefect.server.api.server import SubprocessASGIServer

            if not self._cancelled.is_set():
                SubprocessASGIServer().start()
        except Exception as exc:  # the flow's own client starts it again and reports the failure
            logger.debug("early Prefect server start failed: %s", exc)

    def wait(self) -> None:
        self._thread.join()

    def cancel(self) -> None:
        self._cancelled.set()
        server = sys.modules.get("prefect.server.api.server")
        process = server and server.SubprocessASGIServer().server_process
        if process is not None:
            process.kill()  # still booting: nothing of ours is in its database yet


def prestart_embedded_prefect(store: Store) -> EarlyPrefectServer | None:
    """Start the embedded Prefect server early (see :class:`EarlyPrefectServer`).

    Returns None, starting nothing, when a real server is configured (``PREFECT_API_URL``).
    """
    if not use_embedded_prefect(store):
        return None
    return EarlyPrefectServer()


def prestart_for_config(path: str | Path, overrides: Sequence[str] = ()) -> EarlyPrefectServer | None:
    """:func:`prestart_embedded_prefect` for the store a config names, read before full validation.

    Only the ``orchestration`` section is validated here (no TRL import); a config that is broken
    there starts nothing and is reported by the full validation that follows.
    """
    from pydantic import ValidationError

    from posttrain.config import ConfigError, OrchestrationConfig, read_config_mapping

    try:
        raw = read_config_mapping(path, overrides)
        orchestration = OrchestrationConfig.model_validate(raw.get("orchestration") or {})
    except (ConfigError, ValidationError):
        return None
    return prestart_embedded_prefect(Store.at(orchestration.store))
