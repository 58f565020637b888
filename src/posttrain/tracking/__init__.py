"""All of posttrain's MLflow code: one parent run per pipeline run, one nested run per stage.

Layout in MLflow::

    experiment <tracking.experiment or config name>
      run <config name>                 parent: config.yaml, flattened config params, versions, git
        run data / eval-baseline / sft / eval-sft / grpo-format / ...   one nested run per stage

Design choices, each forced by how MLflow and transformers behave (see ../shared/FACTS.md):

* **Active runs.** MLflow's active-run stack is thread-local, and the caller's own active run (a
  notebook's, ``mlflow run``'s) is not ours. The parent run is therefore never "active": it is
  created and written with an explicit ``MlflowClient`` and run id. A stage run *is* started as the
  active run (``mlflow.start_run(parent_run_id=...)``) in the thread that enters
  :meth:`Tracker.stage`, because transformers' ``MLflowCallback`` logs into the active run of the
  thread calling ``trainer.train()``: enter the stage inside the task that trains. With an active
  run the callback neither starts a second run nor ends ours, unless
  ``MLFLOW_NESTED_RUN``/``MLFLOW_RUN_ID`` are set; the stage hides those two variables while it is
  open.
* **URI.** The callback logs through the global tracking URI, so :func:`start_pipeline_run` sets
  it (``mlflow.set_tracking_uri`` also exports ``$MLFLOW_TRACKING_URI``) and :meth:`Tracker.finish`
  restores the previous value, so nothing leaks into the next run or test.
* **Remote servers.** Only public client calls are used, and artifacts go through
  ``log_dict``/``log_text``/``log_table``/``log_figure``/``log_artifact``, never the filesystem.
* **Disabled.** ``tracking.enabled: false`` gives a :class:`Tracker` without a run: every method
  returns at once and ``report_to`` is ``"none"``, so pipeline code needs no ``if``.
* **Startup cost.** ``import mlflow`` takes ~1.6 s, so it happens inside functions only.
"""

from posttrain.tracking.compare import (
    Comparison,
    RunSummary,
    compare_runs,
    format_comparison,
    plot_comparison,
)
from posttrain.tracking.logged_models import (
    CHAMPION_ALIAS,
    MODEL_ID_TAG,
    Promotion,
    StageModel,
    models_of_runs,
    promote_champion,
    stage_models,
)
from posttrain.tracking.mlflow_io import (
    CACHE_KEY_TAG,
    DEFAULT_TRACKING_URI,
    MAX_PARAM_LENGTH,
    PREFECT_FLOW_RUN_TAG,
    ROLE_TAG,
    experiment_name,
    flatten_params,
    resolve_tracking_uri,
    tracking_problem,
)
from posttrain.tracking.parent_run import (
    Tracker,
    TrackingLost,
    close_abandoned_runs,
    model_requirements,
    open_tracking_store,
    start_pipeline_run,
)
from posttrain.tracking.stage import StageRun

__all__ = [
    "CACHE_KEY_TAG",
    "CHAMPION_ALIAS",
    "MODEL_ID_TAG",
    "Promotion",
    "StageModel",
    "models_of_runs",
    "promote_champion",
    "stage_models",
    "DEFAULT_TRACKING_URI",
    "MAX_PARAM_LENGTH",
    "PREFECT_FLOW_RUN_TAG",
    "ROLE_TAG",
    "Comparison",
    "RunSummary",
    "StageRun",
    "Tracker",
    "TrackingLost",
    "close_abandoned_runs",
    "compare_runs",
    "experiment_name",
    "flatten_params",
    "format_comparison",
    "model_requirements",
    "open_tracking_store",
    "plot_comparison",
    "resolve_tracking_uri",
    "start_pipeline_run",
    "tracking_problem",
]
