"""A LoggedModel per training stage, and the registered model whose ``champion`` alias names the best.

MLflow 3 compares *models*, not runs: each training stage's output becomes a LoggedModel
(``search_logged_models``, the experiment's "Models" tab) whose evaluation metrics are logged
against it (``eval/*``, with the evaluation set as its dataset). The final stage's model holds the
weights when ``tracking.log_model`` is on (:meth:`posttrain.tracking.Tracker.log_final_model`);
every other stage's is a *reference*: tags naming the stage directory in posttrain's store, its
cache key and its ``stage.json`` as the only artifact, so a stage costs milliseconds, not a copy of
its weights. A stage served from cache reuses the LoggedModel of the run that produced it (found by
its cache key), so one stage output is one model however many pipeline runs see it.

:func:`promote_champion` (``posttrain compare --promote``) registers the best stage model of the
compared runs as a version of the registered model named after the config and moves the
``champion`` alias to it. It never moves silently: it returns what it did and why, and it never
replaces a champion that scores higher on the same metric unless forced.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.tracking.mlflow_io import (
    CACHE_KEY_TAG,
    STEP_KIND_TAG,
    STEP_TAG,
    global_tracking_uri,
    mlflow_client,
)

logger = logging.getLogger(__name__)

__all__ = [
    "CHAMPION_ALIAS",
    "MODEL_ROLE",
    "Promotion",
    "StageModel",
    "create_stage_model",
    "find_stage_model",
    "link_model_output",
    "models_of_runs",
    "promote_champion",
    "stage_models",
]

CHAMPION_ALIAS = "champion"
MODEL_ROLE_TAG = "posttrain.role"
MODEL_ROLE = "stage-model"
CONFIG_TAG = "posttrain.config_name"
PIPELINE_RUN_TAG = "posttrain.pipeline_run_id"
OUTPUT_TAG = "posttrain.output_dir"
MODEL_ID_TAG = "posttrain.model_id"
"""On a stage run: the LoggedModel of its output (produced, or reused from the cache's producer)."""
CONTENT_TAG = "posttrain.model_content"
"""``weights`` (an MLflow transformers model) or ``reference`` (tags + stage.json only)."""


def create_stage_model(
    client: Any,
    experiment_id: str,
    *,
    stage: str,
    kind: str | None,
    source_run_id: str,
    pipeline_run_id: str | None,
    config_name: str,
    output_dir: str | Path | None = None,
    cache_key: str | None = None,
    params: Mapping[str, str] | None = None,
    content: str = "reference",
) -> Any:
    """Create (PENDING) the LoggedModel of one stage output, tagged so it can be found and compared."""
    tags = {
        MODEL_ROLE_TAG: MODEL_ROLE,
        STEP_TAG: stage,
        CONFIG_TAG: config_name,
        CONTENT_TAG: content,
        **({STEP_KIND_TAG: kind} if kind else {}),
        **({PIPELINE_RUN_TAG: pipeline_run_id} if pipeline_run_id else {}),
        **({CACHE_KEY_TAG: cache_key} if cache_key else {}),
        **({OUTPUT_TAG: str(Path(output_dir).resolve())} if output_dir else {}),
    }
    return client.create_logged_model(
        experiment_id,
        name=stage,
        source_run_id=source_run_id,
        tags=tags,
        params=dict(params or {}),
        model_type=kind,
    )


def link_model_output(client: Any, run_id: str, model_id: str) -> None:
    """List ``model_id`` among ``run_id``'s outputs: the run page's "Logged models" shows a run's
    model inputs and outputs, not the models whose source run it is. Once only: SQL stores refuse
    the same link twice (MLflow's own ``log_model`` makes one for the weights it logs)."""
    from mlflow.entities import LoggedModelOutput  # heavy: deferred until needed

    client.log_outputs(run_id, [LoggedModelOutput(model_id, step=0)])


def find_stage_model(client: Any, experiment_ids: Sequence[str], cache_key: str) -> str | None:
    """The newest READY stage model produced under ``cache_key``, or None."""
    # MLflow 3.17's filter on `status` matches nothing on SQL stores: READY is checked here.
    found = client.search_logged_models(
        list(experiment_ids),
        filter_string=f"tags.`{CACHE_KEY_TAG}` = '{cache_key}'",
        order_by=[{"field_name": "creation_time", "ascending": False}],
    )
    return next((m.model_id for m in found if _ready(m)), None)


def _ready(model: Any) -> bool:
    return str(model.status) == "READY"


@dataclass(frozen=True)
class StageModel:
    """One stage's LoggedModel as ``compare --promote`` sees it."""

    model_id: str
    stage: str
    config_name: str | None
    pipeline_run_id: str | None
    source_run_id: str | None
    metrics: Mapping[str, float]
    """Latest value of each metric logged against the model (``eval/accuracy_strict``...)."""


def _latest_metrics(model: Any) -> dict[str, float]:
    latest: dict[str, tuple[int, float]] = {}
    for metric in model.metrics or []:
        if metric.key not in latest or metric.timestamp >= latest[metric.key][0]:
            latest[metric.key] = (metric.timestamp, metric.value)
    return {k: v for k, (_, v) in latest.items()}


def _stage_model(model: Any) -> StageModel:
    tags = model.tags or {}
    return StageModel(
        model_id=model.model_id,
        stage=tags.get(STEP_TAG, model.name),
        config_name=tags.get(CONFIG_TAG),
        pipeline_run_id=tags.get(PIPELINE_RUN_TAG),
        source_run_id=model.source_run_id,
        metrics=_latest_metrics(model),
    )


def stage_models(client: Any, experiment_ids: Sequence[str]) -> list[StageModel]:
    """Every READY posttrain stage model of the experiments (one ``search_logged_models`` query)."""
    query = f"tags.`{MODEL_ROLE_TAG}` = '{MODEL_ROLE}'"
    models, token = [], None
    while True:
        page = client.search_logged_models(list(experiment_ids), filter_string=query, page_token=token)
        models += [_stage_model(m) for m in page if _ready(m)]
        token = page.token
        if not token:
            return models


@dataclass(frozen=True)
class Promotion:
    """What ``compare --promote`` did (or would not do), in words and in fields."""

    registered_model: str
    metric: str
    model: StageModel
    value: float
    version: str | None
    previous_version: str | None
    previous_value: float | None
    moved: bool
    message: str


def _metric_key(metric: str) -> str:
    return metric if metric.startswith("eval/") else f"eval/{metric}"


def _champion(client: Any, name: str) -> Any | None:
    from mlflow.exceptions import MlflowException  # heavy: deferred until needed

    try:
        return client.get_model_version_by_alias(name, CHAMPION_ALIAS)
    except MlflowException:
        return None


def _version_of(client: Any, name: str, model_id: str) -> Any | None:
    source = f"models:/{model_id}"
    return next((v for v in client.search_model_versions(f"name = '{name}'") if v.source == source), None)


def promote_champion(
    tracking_uri: str,
    candidates: Sequence[StageModel],
    metric: str = "accuracy_strict",
    *,
    registered_model: str | None = None,
    force: bool = False,
) -> Promotion:
    """Move the ``champion`` alias to the candidate with the highest ``eval/<metric>``.

    The registered model is named after the config (``registered_model`` overrides it). The
    candidate is registered as a version if it is not one yet. A current champion that scores
    higher on the same metric stays unless ``force``. Raises ValueError when no candidate has the
    metric.
    """
    key = _metric_key(metric)
    scored = [(c.metrics[key], c) for c in candidates if key in c.metrics]
    if not scored:
        raise ValueError(f"no stage model of these runs has the metric {key!r}")
    value, best = max(scored, key=lambda pair: pair[0])
    name = registered_model or best.config_name
    if not name:
        raise ValueError("the best stage model has no config name: pass a registered model name")
    client = mlflow_client(tracking_uri)
    champion = _champion(client, name)
    before = champion.version if champion is not None else None
    previous_value = _score(client, champion, candidates, key) if champion is not None else None

    def kept(message: str) -> Promotion:
        return Promotion(name, key, best, value, before, before, previous_value, False, message)

    if champion is not None:
        where = f"{name} v{champion.version}"
        if champion.source == f"models:/{best.model_id}":
            return kept(f"champion unchanged: {where} is already the best, {best.stage} ({key} {value:.4g})")
        if previous_value is not None and previous_value > value and not force:
            return kept(
                f"champion kept: {where} scores {key} {previous_value:.4g}, above the best candidate "
                f"{best.stage} ({value:.4g}); pass --force to move it anyway"
            )
    with global_tracking_uri(tracking_uri):  # the registry resolves models:/<id> through the global URI
        version = _register(client, name, best, key, value)
    client.set_registered_model_alias(name, CHAMPION_ALIAS, version)
    was = "no champion before" if before is None else f"was v{before}"
    if previous_value is not None:
        was += f" at {previous_value:.4g}"
    message = (
        f"champion: {name} v{version} = {best.stage} of run {(best.pipeline_run_id or '?')[:12]} "
        f"({key} {value:.4g}; {was})"
    )
    logger.info(message)
    return Promotion(name, key, best, value, version, before, previous_value, True, message)


def _score(client: Any, champion: Any, candidates: Sequence[StageModel], key: str) -> float | None:
    """The current champion's ``key``, or None when its LoggedModel is gone or lacks the metric."""
    from mlflow.exceptions import MlflowException  # heavy: deferred until needed

    model_id = champion.source.removeprefix("models:/")
    known = next((c for c in candidates if c.model_id == model_id), None)
    if known is None:
        try:
            known = _stage_model(client.get_logged_model(model_id))
        except MlflowException:
            return None
    return known.metrics.get(key)


def models_of_runs(client: Any, pipeline_run_ids: Sequence[str]) -> list[StageModel]:
    """The stage models the given pipeline runs produced or reused (their stage runs' ``posttrain.model_id``)."""
    if not pipeline_run_ids:
        return []
    everywhere = [e.experiment_id for e in client.search_experiments()]
    parents = set(pipeline_run_ids)
    oldest = min(client.get_run(r).info.start_time for r in parents)
    # No `IN` for tags in MLflow's filter: stage runs with a model since the oldest run, matched here.
    children = client.search_runs(
        everywhere, f"tags.`{MODEL_ID_TAG}` LIKE '%' AND attributes.start_time >= {oldest}"
    )
    wanted = {r.data.tags[MODEL_ID_TAG] for r in children if r.data.tags.get("mlflow.parentRunId") in parents}
    return [m for m in stage_models(client, everywhere) if m.model_id in wanted]


def _register(client: Any, name: str, model: StageModel, key: str, value: float) -> str:
    from mlflow.exceptions import MlflowException  # heavy: deferred until needed

    with contextlib.suppress(MlflowException):  # already registered
        client.create_registered_model(name, tags={"posttrain.config_name": name})
    existing = _version_of(client, name, model.model_id)
    if existing is not None:
        return existing.version
    created = client.create_model_version(
        name,
        source=f"models:/{model.model_id}",
        run_id=model.source_run_id,
        tags={STEP_TAG: model.stage, "posttrain.promoted_on": key, "posttrain.promoted_value": str(value)},
        model_id=model.model_id,
    )
    _wait_ready(client, name, created.version)
    return created.version


def _wait_ready(client: Any, name: str, version: str, timeout: float = 30.0) -> None:
    """A remote registry creates versions asynchronously; aliases need a READY version."""
    deadline = time.monotonic() + timeout
    while client.get_model_version(name, version).status == "PENDING_REGISTRATION":
        if time.monotonic() > deadline:
            return
        time.sleep(0.2)
