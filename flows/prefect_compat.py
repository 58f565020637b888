"""The one place posttrain touches a private part of Prefect: the embedded server's process.

Without ``PREFECT_API_URL`` Prefect serves its API from ``SubprocessASGIServer`` (in
``prefect.server.api.server``, not a public API), a per-process singleton that Prefect starts
lazily at a flow's first API call. posttrain starts that same singleton early, in the background,
so its 7-8 s boot overlaps config validation and the torch/TRL imports, and kills it when the run
stops before its flow (a config error), so the error is not held up by a graceful shutdown.

Prefect stops that server from an ``atexit`` hook, which a process killed with SIGKILL never runs:
the uvicorn child would live on, holding its port and the store's Prefect database. posttrain
therefore starts it through :data:`WATCHDOG`, a few lines that run the same uvicorn command in the
server process beside a thread that shuts the server down when its parent is gone (its parent pid
changes). Linux's ``PR_SET_PDEATHSIG`` is no substitute: it fires when the *thread* that started
the child ends, and the server is started from a short-lived background thread.

The server runs in a session of its own. Ctrl-C in a terminal signals the whole foreground process
group: in posttrain's group the server would stop at once, and the interrupted run would then spend
minutes retrying to tell it that the flow run crashed (and a run whose ``KeyboardInterrupt`` Python
swallowed, in a weakref callback say, would go on without its API). Out of the group it records the
interruption and stops with posttrain, by Prefect's ``atexit`` hook or the watchdog.

``PREFECT_VERSIONS`` is the range this was checked against (pyproject pins the same);
``tests/system/test_prefect_compat.py`` fails when the installed Prefect leaves it, the singleton's shape
changes, or Prefect's own uvicorn command differs from the one posttrain runs, which is the signal
to re-check this module before lifting the pin.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

Redactor = Callable[[dict[str, Any]], dict[str, Any]]

__all__ = [
    "PREFECT_VERSIONS",
    "WATCHDOG",
    "import_embedded_server",
    "kill_embedded_server",
    "redact_stored_parameters",
    "start_embedded_server",
    "store_parameters_redacted",
    "uvicorn_dying_with_parent",
]

PREFECT_VERSIONS = (">=3.9", "<3.10")
_SERVER_MODULE = "prefect.server.api.server"
_REPLACED: dict[str, Any] = {}
"""Prefect's own methods posttrain replaced, by name (the compat test compares against them)."""

WATCHDOG = """\
import os, runpy, signal, sys, threading, time
parent, module = int(sys.argv[1]), sys.argv[2]
del sys.argv[1:3]
def watch():
    while os.getppid() == parent:
        time.sleep(0.25)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(5)
    os._exit(1)
threading.Thread(target=watch, name="parent-watch", daemon=True).start()
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""
"""``python -c WATCHDOG PARENT_PID MODULE ARGS...`` runs ``python -m MODULE ARGS...`` and ends it
(SIGTERM, then exit after 5 s) once process ``PARENT_PID`` is no longer its parent."""


def uvicorn_dying_with_parent(server: Any) -> subprocess.Popen:
    """``SubprocessASGIServer._run_uvicorn_command`` of Prefect 3.9, run under :data:`WATCHDOG` in a
    session of its own (module docstring).

    The same arguments and environment as Prefect's (a test compares them), with ``-m uvicorn``
    replaced by the watchdog and this process's pid.
    """
    import prefect  # heavy: only when the server starts
    from prefect.settings import get_current_settings

    server_env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
    return subprocess.Popen(
        args=[
            sys.executable,
            "-c",
            WATCHDOG,
            str(os.getpid()),
            "uvicorn",
            "--app-dir",
            str(prefect.__module_path__.parent),
            "--factory",
            "prefect.server.api.server:create_app",
            "--host",
            "127.0.0.1",
            "--port",
            str(server.port),
            "--log-level",
            "error",
            "--lifespan",
            "on",
        ],
        env={
            **os.environ,
            **server_env,
            **get_current_settings().to_environment_variables(exclude_unset=True),
        },
        start_new_session=True,
    )


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
    """Start (or join) the process-wide embedded API server Prefect's client would start itself,
    as a process that ends when this one dies (module docstring)."""
    from prefect.server.api.server import SubprocessASGIServer  # heavy: imports the server app

    # On the class: a server Prefect restarts itself (its port taken) runs the same way.
    if SubprocessASGIServer.__dict__["_run_uvicorn_command"] is not uvicorn_dying_with_parent:
        _REPLACED["_run_uvicorn_command"] = SubprocessASGIServer._run_uvicorn_command
        SubprocessASGIServer._run_uvicorn_command = uvicorn_dying_with_parent
    SubprocessASGIServer().start()


def kill_embedded_server() -> None:
    """Kill the embedded server's process if one was started (nothing of ours is in it yet)."""
    server = sys.modules.get(_SERVER_MODULE)
    process = server and server.SubprocessASGIServer().server_process
    if process is not None:
        process.kill()


def store_parameters_redacted(flow: Any, redact: Redactor) -> Any:
    """Have Prefect store ``redact(parameters)`` for the runs of ``flow`` this process creates.

    Prefect stores a flow run's parameters as ``flow.serialize_parameters(parameters)`` when the run
    is created (called directly, or as a subflow); the flow itself still receives the real values.
    Returns ``flow``. A copy made with ``flow.with_options`` does not keep this.
    """
    serialize = flow.serialize_parameters
    flow.serialize_parameters = lambda parameters: redact(serialize(parameters))
    return flow


def redact_stored_parameters(redact: Redactor) -> bool:
    """Inside a flow run: replace its stored parameters by ``redact(stored)`` where they differ.

    A deployment's runs are created by whoever triggers them, with the parameters they pass, before
    any posttrain code runs; this overwrites them as the run starts. Returns True if it did.
    """
    from prefect import get_client
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return False
    stored = dict(context.flow_run.parameters)
    cleaned = redact(stored)
    if cleaned == stored:
        return False
    with get_client(sync_client=True) as client:
        client.update_flow_run(context.flow_run.id, parameters=cleaned)
    return True
