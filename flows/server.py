"""Prefect's embedded server: where its home lives, and starting it early so its boot overlaps work.

Without ``PREFECT_API_URL`` Prefect runs an ephemeral API server (a uvicorn subprocess, 7-8 s on 2
cores to boot) on SQLite under ``PREFECT_HOME``; posttrain keeps that home inside the store, so a
store is self-contained. With ``PREFECT_API_URL`` set, the real server is used and nothing here
changes anything.

Nothing here imports Prefect at module level: its settings are read when ``prefect`` is first
imported, so :func:`use_embedded_prefect` must run before that.
"""

from __future__ import annotations

import logging
import os
import threading
from urllib.parse import urlsplit

from posttrain.cache.store import Store
from posttrain.core.net import unreachable
from posttrain.flows.prefect_compat import import_embedded_server, kill_embedded_server, start_embedded_server

logger = logging.getLogger(__name__)

__all__ = [
    "EarlyPrefectServer",
    "prefect_api_problem",
    "prestart_embedded_prefect",
    "quiet_run_failures_on_console",
    "use_embedded_prefect",
]


def use_embedded_prefect(store: Store) -> bool:
    """Point Prefect at an ephemeral API whose home is inside the store, unless a server is configured.

    Must run before `prefect` is imported: Prefect reads its settings at import. With
    ``PREFECT_API_URL`` set, the real server is used and nothing is changed. Returns True when the
    embedded mode is in effect.
    """
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # Prefect gives its embedded server 20 s to boot; on a busy 2-core machine it needs 7-18 s
    # alone, so a run that starts while the machine is loaded would fail before doing anything.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    if os.environ.get("PREFECT_API_URL"):
        return False
    os.environ.setdefault("PREFECT_HOME", str(store.prefect_home))
    return True


class EarlyPrefectServer:
    """Prefect's embedded API server, started in the background before the flow needs it.

    Prefect starts its ephemeral server (a uvicorn subprocess, 7-8 s on 2 cores) lazily, at the
    flow's first API call, after the config has been validated and torch/TRL imported. Starting it
    first lets the two overlap. The server is a per-process singleton (see :mod:`.prefect_compat`),
    so the flow's client finds it running. Call :meth:`wait` before the flow starts, so it never sees a
    half-started server, or :meth:`cancel` when the run stops before its flow (a config error), so
    the error is not held up by the server's graceful shutdown.
    """

    def __init__(self) -> None:
        import_embedded_server()  # here, not in the thread: see prefect_compat.import_embedded_server
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._start, name="prefect-server-start", daemon=True)
        self._thread.start()

    def _start(self) -> None:
        try:
            if not self._cancelled.is_set():
                start_embedded_server()
        except Exception as exc:  # the flow's own client starts it again and reports the failure
            logger.debug("early Prefect server start failed: %s", exc)

    def wait(self) -> None:
        self._thread.join()

    def cancel(self) -> None:
        self._cancelled.set()
        kill_embedded_server()  # still booting: nothing of ours is in its database yet


def prestart_embedded_prefect(store: Store) -> EarlyPrefectServer | None:
    """Start the embedded Prefect server early (see :class:`EarlyPrefectServer`).

    Returns None, starting nothing, when a real server is configured (``PREFECT_API_URL``).
    """
    if not use_embedded_prefect(store):
        return None
    return EarlyPrefectServer()


def prefect_api_problem() -> str | None:
    """Why the Prefect server ``PREFECT_API_URL`` names cannot be used (None: it answers, or none is
    configured and the embedded one will be used), found in seconds instead of after retries."""
    url = os.environ.get("PREFECT_API_URL")
    if not url:
        return None
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return "not an http(s) URL of a Prefect API (http://host:4200/api)"
    problem = unreachable(url.rstrip("/") + "/health")
    return f"Prefect server unreachable: {problem}" if problem else None


def quiet_run_failures_on_console() -> None:
    """Keep Prefect's flow- and task-run loggers off the console (their records still reach the API).

    A failing step makes Prefect log the same traceback twice (task run, then flow run) before the
    exception reaches the CLI, which reports an expected error as one line and an unexpected one with
    its traceback anyway. Call after ``prefect`` is imported (its logging setup adds the handlers).
    """
    for name in ("prefect.flow_runs", "prefect.task_runs"):
        logging.getLogger(name).propagate = False
