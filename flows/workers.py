"""The processes posttrain's tasks run in beside the flow: evaluations beside training
(``orchestration.concurrent_evals``) and a sweep's points side by side (``sweep --parallel N``).

Prefect's ``ProcessPoolTaskRunner`` runs a submitted task's whole engine in a worker process it
spawns (a fresh interpreter: the task's arguments and its result travel pickled, posttrain's are
a config, paths and small frozen results). The task's concurrency slot, the ``gpu`` tag limit of
``orchestration.gpu_slots``, is taken there from the Prefect server, so the limit bounds processes
wherever they run. Nothing a step does to its process (transformers' model building, accelerate's
process-wide state, MLflow's logging threads) reaches another step.

A worker starts with :func:`prepare_worker`; :func:`workers_use_this_api` points the workers of a
flow run at the flow's own Prefect API.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator

from prefect.task_runners import ProcessPoolTaskRunner

from posttrain.core.redact import RedactingFormatter, redacting_log_records
from posttrain.flows.prefect_ui import api_log_handler

__all__ = ["prepare_worker", "worker_processes", "workers_use_this_api"]

_FOR_LIFE = contextlib.ExitStack()
"""What a worker enters once and never leaves (the redacting log-record factory)."""


def worker_processes(max_workers: int | None = None) -> ProcessPoolTaskRunner:
    """Prefect's process-pool task runner with posttrain's worker setup; ``max_workers`` defaults
    to Prefect's ``PREFECT_TASKS_RUNNER_PROCESS_POOL_MAX_WORKERS``, else the number of CPUs."""
    return ProcessPoolTaskRunner(max_workers=max_workers, initializer=prepare_worker)


def prepare_worker() -> None:
    """In a new worker process: end it when the flow's process is gone, redact its log records as
    the CLI does, and send posttrain's log lines to the task run's logs in Prefect (warnings also
    to the console, beside the step's progress bars).

    A worker whose parent was killed would otherwise finish its step and write into the store
    beside the next run of it.
    """
    parent = os.getppid()

    def exit_with_parent() -> None:
        while os.getppid() == parent:
            time.sleep(0.25)
        os._exit(1)

    threading.Thread(target=exit_with_parent, name="exit-with-parent", daemon=True).start()
    _FOR_LIFE.enter_context(redacting_log_records())
    logger = logging.getLogger("posttrain")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    console = logging.StreamHandler()
    console.setLevel(logging.WARNING)
    console.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    logger.addHandler(console)
    logger.addHandler(api_log_handler(logging.INFO))


@contextlib.contextmanager
def workers_use_this_api() -> Iterator[None]:
    """Inside a flow run: its workers talk to this process's Prefect API. Without ``PREFECT_API_URL``
    (the embedded server) a worker would start an embedded server of its own on the same database;
    the address goes into the settings Prefect hands every task it runs in a worker."""
    from prefect.context import FlowRunContext
    from prefect.settings import PREFECT_API_URL, temporary_settings

    context = FlowRunContext.get()
    if PREFECT_API_URL.value() or context is None:
        yield
        return
    with temporary_settings({PREFECT_API_URL: str(context.client.api_url).rstrip("/")}):
        yield
