"""The one place posttrain touches a private part of Prefect: the embedded server's process.

Without ``PREFECT_API_URL`` Prefect serves its API from ``SubprocessASGIServer`` (in
``prefect.server.api.server``, not a public API), a per-process singleton that Prefect starts
lazily at a flow's first API call. posttrain starts that same singleton early, in the background,
so its 7-8 s boot overlaps config validation and the torch/TRL imports, and kills it when the run
stops before its flow (a config error), so the error is not held up by a graceful shutdown.

``PREFECT_VERSIONS`` is the range this was checked against (pyproject pins the same);
``tests/test_compat.py`` fails when the installed Prefect leaves it or the singleton's shape
changes, which is the signal to re-check this module before lifting the pin.
"""

from __future__ import annotations

import sys

__all__ = ["PREFECT_VERSIONS", "import_embedded_server", "kill_embedded_server", "start_embedded_server"]

PREFECT_VERSIONS = (">=3.9", "<3.10")
_SERVER_MODULE = "prefect.server.api.server"


def import_embedded_server() -> None:
    """Import the server app (and with it Prefect's SQLAlchemy ORM models) in the calling thread.

    Call before starting the server from a background thread while the main thread may open
    MLflow's SQL store: SQLAlchemy configures the mappers of *every* declarative class when MLflow's
    store initialises, and a Prefect model class half-defined by an import in another thread then
    fails it (``InvalidRequestError: expression 'FlowRun' failed to locate a name``, seen about once
    in five runs on a loaded 2-core machine).
    """
    import prefect.server.api.server  # noqa: F401  heavy: the server app and the ORM models


def start_embedded_server() -> None:
    """Start (or join) the process-wide embedded API server Prefect's client would start itself."""
    from prefect.server.api.server import SubprocessASGIServer  # heavy: imports the server app

    SubprocessASGIServer().start()


def kill_embedded_server() -> None:
    """Kill the embedded server's process if one was started (nothing of ours is in it yet)."""
    server = sys.modules.get(_SERVER_MODULE)
    process = server and server.SubprocessASGIServer().server_process
    if process is not None:
        process.kill()
