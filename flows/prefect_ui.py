"""What posttrain shows in Prefect: flow runs named after their config, its own log lines in each
run's logs, health alerts as events.

**Names.** A flow run is named after its config and Prefect's random slug (``smoke-brave-spider``,
:func:`config_run_name`), so the runs list tells configs apart, and runs of one config apart.

**Logs.** Prefect sends to its API only the records of its own loggers (and of those named in
``PREFECT_LOGGING_EXTRA_LOGGERS``). :func:`posttrain_logs_to_prefect` attaches Prefect's
``APILogHandler`` to the ``posttrain`` logger for the duration of a flow run, so every line a step
logs (stage start, examples, rewards, evaluation progress, done in N s) appears in that task run's
logs in the UI, whether the flow was started by ``posttrain run``, ``posttrain serve`` or a worker.
Records from threads outside any run are left out instead of warning.

**Events.** Each health alert of a training stage (``training/health.py``: ``no_signal``,
``kl_blowup``, ...) is emitted as a Prefect event named ``posttrain.health.<kind>``, whose resource
is the stage (``posttrain.stage.<config>.<step>``) and whose related resources are the flow run,
the task run and the MLflow run, so an automation can notify someone, cancel the flow run or run a
deployment again (docs/tracking.md, "Health alerts as Prefect events"). The library never imports Prefect:
alerts come back in the stage's result and the flow emits them.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from prefect.events import emit_event
from prefect.logging.handlers import APILogHandler

__all__ = [
    "HEALTH_EVENT_PREFIX",
    "api_log_handler",
    "config_run_name",
    "emit_health_alerts",
    "health_alert_events",
    "posttrain_logs_to_prefect",
]

HEALTH_EVENT_PREFIX = "posttrain.health."
_LOGGER = "posttrain"


class _InRunContext(logging.Filter):
    """Pass only records logged inside a Prefect flow or task run (the API handler needs one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        from prefect.context import FlowRunContext, TaskRunContext

        return FlowRunContext.get() is not None or TaskRunContext.get() is not None


def config_run_name() -> str:
    """The name of the flow run being started: its config's name (the ``config`` parameter, a config
    or a config file's path; a sweep's first of ``configs``) and Prefect's random slug. Prefect calls
    it as the run starts, with the parameters as given (validated or, from a deployment, raw)."""
    from prefect.runtime import flow_run
    from prefect.utilities.names import generate_slug

    parameters = flow_run.parameters
    config = parameters.get("config")
    if config is None and parameters.get("configs"):
        config = parameters["configs"][0]
    if isinstance(config, str):
        name = Path(config).stem
    elif isinstance(config, Mapping):
        name = config.get("name")
    else:
        name = getattr(config, "name", None)
    slug = generate_slug(2)
    return f"{name}-{slug}" if isinstance(name, str) and name else slug


def api_log_handler(level: int = logging.INFO) -> APILogHandler:
    """Prefect's API log handler for posttrain's records logged inside a flow or task run."""
    handler = APILogHandler(level=level)
    handler.addFilter(_InRunContext())
    return handler


@contextlib.contextmanager
def posttrain_logs_to_prefect(level: int = logging.INFO) -> Iterator[None]:
    """Send the ``posttrain`` logger's records (``level`` and up) to the current Prefect run's logs.

    The logger's level is lowered to ``level`` while the block runs if it was higher (it inherits
    WARNING from the root logger when nothing configured logging), and restored after.
    """
    logger = logging.getLogger(_LOGGER)
    if any(isinstance(h, APILogHandler) for h in logger.handlers):  # nested flow, or extra loggers
        yield
        return
    handler = api_log_handler(level)
    previous = logger.level
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


def health_alert_events(
    config_name: str,
    step: str,
    alerts: Sequence[Mapping[str, Any]],
    *,
    mlflow_run_id: str | None = None,
    task_run_id: Any = None,
) -> list[dict[str, Any]]:
    """The keyword arguments of one ``emit_event`` per alert (pure, so it is tested without a server)."""
    resource = {
        "prefect.resource.id": f"posttrain.stage.{config_name}.{step}",
        "prefect.resource.name": step,
        "posttrain.config": config_name,
        "posttrain.stage": step,
    }
    related = []
    if task_run_id is not None:
        related.append(
            {"prefect.resource.id": f"prefect.task-run.{task_run_id}", "prefect.resource.role": "task-run"}
        )
    if mlflow_run_id:
        related.append(
            {"prefect.resource.id": f"mlflow.run.{mlflow_run_id}", "prefect.resource.role": "mlflow-run"}
        )
    events = []
    for alert in alerts:
        kind = str(alert.get("kind", "unknown"))
        events.append(
            {
                "event": f"{HEALTH_EVENT_PREFIX}{kind}",
                "resource": {**resource, "posttrain.alert": kind},
                "related": related,
                "payload": {
                    k: v for k, v in alert.items() if isinstance(v, str | int | float | bool) or v is None
                },
            }
        )
    return events


def emit_health_alerts(
    config_name: str,
    step: str,
    alerts: Sequence[Mapping[str, Any]],
    *,
    mlflow_run_id: str | None = None,
    task_run_id: Any = None,
) -> int:
    """Emit one Prefect event per health alert (the flow run is related automatically); returns how many."""
    events = health_alert_events(
        config_name, step, alerts, mlflow_run_id=mlflow_run_id, task_run_id=task_run_id
    )
    for event in events:
        emit_event(**event)
    return len(events)
