"""The parent MLflow run of one pipeline run, cached-stage records, and the final model."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from posttrain.core.config import PipelineConfig, cache_form, dump_config
from posttrain.core.errors import ConfigError, PosttrainError
from posttrain.core.hashing import package_versions, stable_hash
from posttrain.core.metric_names import is_interval_metric, parse_metric_name
from posttrain.core.redact import redact_text
from posttrain.core.sweep import seed_group
from posttrain.tracking.compare import accuracy_by_stage_figure, eval_metrics_by_stage, in_plan_order
from posttrain.tracking.headline import format_headline
from posttrain.tracking.logged_models import create_stage_model, find_stage_model, link_model_output
from posttrain.tracking.mlflow_io import (
    CACHE_KEY_TAG,
    ROLE_TAG,
    SEED_GROUP_TAG,
    STEP_KIND_TAG,
    STEP_TAG,
    STEPS_TAG,
    STORE_TAG,
    TRACKED_PACKAGES,
    callback_env_guard,
    copy_metric_history,
    experiment_name,
    flatten_params,
    flush_async_logging,
    git_commit,
    mirror_eval,
    mlflow_client,
    prompt_async_flush,
    resolve_tracking_uri,
    retry_dataset_race,
    send_metric_values,
    send_params,
    sqlite_path,
    truncate,
    uri_problem,
)
from posttrain.tracking.stage import StageRun

logger = logging.getLogger(__name__)

_LOCAL_MODEL_NOTICES = ("The model card could not be retrieved", "Unable to find license information")
"""What ``mlflow.transformers.log_model`` warns for every model that is a local directory: it looks
the model's card and license up on the hub, and a stage's output has neither."""


@contextlib.contextmanager
def _without_local_model_notices() -> Iterator[None]:
    """Drop :data:`_LOCAL_MODEL_NOTICES` while a stage's model is logged; other warnings pass."""
    mlflow_logger = logging.getLogger("mlflow.transformers")

    def keep(record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(_LOCAL_MODEL_NOTICES)

    mlflow_logger.addFilter(keep)
    try:
        yield
    finally:
        mlflow_logger.removeFilter(keep)


# --------------------------------------------------------------------------- the pipeline run


@contextlib.contextmanager
def _no_retries() -> Iterator[None]:
    """MLflow calls that give up at the first failure (a server already known to be gone): MLflow
    reads its retry count from the environment at each request."""
    previous = os.environ.get("MLFLOW_HTTP_REQUEST_MAX_RETRIES")
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("MLFLOW_HTTP_REQUEST_MAX_RETRIES", None)
        else:
            os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = previous


_PARAM_PREFIXES = {"data": "data", "eval": "eval", "score": "pass_rate"}


def param_prefix(kind: str | None) -> str:
    """The prefix of a step run's config params: the section's own name where the step reads one
    section of the config (``eval.baseline``, not ``stage.baseline``, which reads as a property of
    the run), ``stage`` for a training stage's section.

    >>> param_prefix("eval"), param_prefix("grpo"), param_prefix(None)
    ('eval', 'stage', 'stage')
    """
    return _PARAM_PREFIXES.get(kind or "", "stage")


def _config_params(params: Mapping[str, str], kind: str | None) -> dict[str, str]:
    """The config params a cached copy takes from its producer, named as this posttrain names them:
    a producer an older posttrain logged named every step's section ``stage.*``.

    >>> _config_params({"eval.limit": "8", "dataset.heldout.split": "dev", "num_examples": "8"}, "eval")
    {'eval.limit': '8', 'dataset.heldout.split': 'dev'}
    >>> _config_params({"stage.limit": "8"}, "eval"), _config_params({"stage.lr": "1e-05"}, "sft")
    ({'eval.limit': '8'}, {'stage.lr': '1e-05'})
    """
    own = param_prefix(kind)
    found = {k: v for k, v in params.items() if k.startswith(f"{own}.")}
    if not found and own != "stage":
        found = {f"{own}.{k.removeprefix('stage.')}": v for k, v in params.items() if k.startswith("stage.")}
    if kind == "eval":  # what each evaluation set is (log_eval's data_info)
        found.update({k: v for k, v in params.items() if k.startswith("dataset.")})
    return found


def _copy_inputs(client: Any, producer: Any, run_id: str) -> None:
    """The producer's datasets and input models, as inputs of its cached copy ``run_id``."""
    from mlflow.entities import LoggedModelInput  # heavy: deferred until needed

    inputs = producer.inputs
    datasets = list(inputs.dataset_inputs or []) if inputs else []
    models = [LoggedModelInput(m.model_id) for m in (inputs.model_inputs or [])] if inputs else []
    if datasets or models:
        retry_dataset_race(
            lambda: client.log_inputs(run_id, datasets=datasets or None, models=models or None)
        )


def ended_status(exc: BaseException | None) -> str:
    """The MLflow status of a run its block left with ``exc``: an error fails it; Ctrl-C, SIGTERM
    (Prefect raises its ``TerminationSignal``) or an exit kills it, the work done so far kept."""
    if exc is None:
        return "FINISHED"
    return "FAILED" if isinstance(exc, Exception) else "KILLED"


class TrackingLost(PosttrainError, RuntimeError):
    """The tracking server (or database) went away while a pipeline ran. Every step's output and
    cache record are in the store, so the same command, once it is back, logs what is missing
    (each step served from cache: nothing retrains)."""


_RETRY_CHATTER = (
    "urllib3.connectionpool",  # a warning per retry of every call
    "mlflow.utils.async_logging.async_logging_queue",  # an error per queued batch of the callback
    "mlflow.system_metrics.system_metrics_monitor",  # a warning per sample it cannot send
    "mlflow.utils.rest_utils",
)
"""Loggers that repeat, call after call, that a tracking server is gone: once a run has said so in
one line, they are silenced for the rest of the process."""

_BACKGROUND_FAILURES = _RETRY_CHATTER[1:3]
"""The loggers of MLflow's background threads that report a call given up after its retries: the
trainer callback's queued metrics, the system metrics. Watched while a stage trains, so an outage
is noticed at its first lost batch instead of at the stage's end (an hour of errors later)."""


_OUTAGE_LOCK = threading.Lock()
"""Makes :meth:`Tracker.went_away`'s check-and-set one step. MLflow's background threads (the
async logging queue's workers, the system-metrics monitor) call it through :class:`_OutageWatch`
and can fail at the same moment; without it each saw tracking still on and said the outage again.
Module-level because a Tracker is pickled to stage processes (a lock is not picklable)."""


class _OutageWatch(logging.Filter):
    """A logging filter on :data:`_BACKGROUND_FAILURES` while a stage runs: the first failure it
    sees asks :meth:`Tracker.went_away`; once tracking is lost, their records are dropped."""

    def __init__(self, tracker: Tracker, during: str):
        super().__init__()
        self.tracker, self.during = tracker, during

    def filter(self, record: logging.LogRecord) -> bool:
        if self.tracker.lost is None and record.levelno >= logging.WARNING:
            self.tracker.went_away(self.during, RuntimeError(record.getMessage()))
        return self.tracker.lost is None


@dataclass
class Tracker:
    """The parent run of one pipeline run (or a disabled stand-in). Picklable: plain fields only."""

    enabled: bool = False
    tracking_uri: str | None = None
    experiment_id: str | None = None
    run_id: str | None = None
    log_models: bool = False
    _previous_uri: str | None = field(default=None, repr=False)
    config_name: str | None = None
    system_metrics: bool = False
    """Stage runs log CPU/RAM/disk/network (and GPU) metrics (``log_system_metrics=True``)."""
    _finished: bool = field(default=False, repr=False)
    lost: str | None = None
    """Why tracking stopped in the middle of this run (:meth:`went_away`); None while it works."""
    experiment_name: str | None = None
    """The experiment the run went to, however it was chosen (config, an MLflow variable, an outer
    run), for the lines that tell the user where to look."""

    @property
    def report_to(self) -> list[str] | str:
        """TRL ``report_to`` for training code: ``["mlflow"]`` when tracking, else ``"none"``."""
        return ["mlflow"] if self.enabled else "none"

    def _use_uri(self) -> None:
        """Fluent calls (start_run, the trainer callback, log_model) follow the global URI: point it here.

        Normally already set by :func:`start_pipeline_run`; not so in a process that unpickled us.
        """
        import mlflow  # heavy: deferred until needed

        if mlflow.get_tracking_uri() != self.tracking_uri:
            mlflow.set_tracking_uri(self.tracking_uri)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(ended_status(exc))

    def went_away(self, during: str, exc: BaseException) -> bool:
        """Whether ``exc``, raised by MLflow calls made ``during`` a step, means that the tracking
        server or database is gone. If so, tracking is off for the rest of this run (every method
        returns at once, :attr:`lost` says why) and the pipeline goes on; otherwise (the server
        answers: a bug, a refused value) the caller re-raises.

        MLflow retries each call first (``MLFLOW_HTTP_REQUEST_MAX_RETRIES``, backoff
        ``MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR``), so a server that restarts within that time is
        never noticed."""
        with _OUTAGE_LOCK:
            if self.lost is not None:
                return True
            if not self.enabled or self.tracking_uri is None:
                return False
            problem = uri_problem(self.tracking_uri)
            if problem is None:
                return False
            self.lost = f"{problem} (during {during})"
            self.enabled = False
        for name in _RETRY_CHATTER:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        logger.warning(
            "MLflow tracking at %s went away during %s: the pipeline goes on without it (%s: %s)",
            redact_text(self.tracking_uri),
            during,
            type(exc).__name__,
            redact_text(" ".join(str(exc).split())[:200]),
        )
        return True

    def lost_error(self, store: str) -> TrackingLost:
        """The one-line error a run ends with when tracking went away during it."""
        return TrackingLost(
            f"MLflow tracking at {redact_text(self.tracking_uri or '')} went away: {self.lost}. "
            f"Every step's output is in the store {store}; once the server is back, run the same "
            "command again: it logs what is missing from the store and retrains nothing"
        )

    @contextlib.contextmanager
    def stage(
        self,
        name: str,
        *,
        kind: str | None = None,
        params: Any = None,
        cache_key: str | None = None,
        tags: Mapping[str, Any] | None = None,
    ) -> Iterator[StageRun]:
        """A nested run named after the plan step ``name`` (of ``kind``), active in this thread
        while the block runs.

        ``report_to=["mlflow"]`` training inside the block logs into it. ``cache_key`` tags the run
        as the producer of that cache entry (see :meth:`find_producer`). An exception marks it FAILED.
        """
        if not self.enabled:
            yield StageRun(name)
            return
        import mlflow  # heavy: deferred until needed

        self._use_uri()
        run_tags = {STEP_TAG: name, **({STEP_KIND_TAG: kind} if kind else {}), **(tags or {})}
        if cache_key:
            run_tags[CACHE_KEY_TAG] = cache_key
        run_tags["mlflow.parentRunId"] = self.run_id
        # Created with the client, then resumed as the active run: start_run(parent_run_id=...)
        # refuses a parent other than the thread's active run, which is the caller's own run when
        # posttrain runs inside `with mlflow.start_run():`.
        created = None
        try:
            created = mlflow_client(self.tracking_uri).create_run(
                self.experiment_id, run_name=name, tags={k: str(v) for k, v in run_tags.items()}
            )
            with callback_env_guard():
                run = mlflow.start_run(
                    run_id=created.info.run_id,
                    nested=True,
                    log_system_metrics=True if self.system_metrics else None,
                )
            stage = StageRun(name, run.info.run_id, self.run_id, self.tracking_uri)
            if params is not None:
                stage.log_params(params, param_prefix(kind))
        except Exception as exc:
            active = mlflow.active_run()
            if created is not None and active is not None and active.info.run_id == created.info.run_id:
                with contextlib.suppress(Exception), _no_retries():
                    mlflow.end_run("FAILED")
            if not self.went_away(name, exc):
                raise
            yield StageRun(name)
            return
        # Ended by hand, not by start_run's block: a run whose server went away during the step
        # must not fail the step (its output is recorded) nor wait on the server a second time.
        status = "FAILED"
        watch = _OutageWatch(self, name)
        for logger_name in _BACKGROUND_FAILURES:
            logging.getLogger(logger_name).addFilter(watch)
        try:
            with callback_env_guard():
                yield stage
            status = "FINISHED"
        except BaseException as exc:
            status = ended_status(exc)
            raise
        finally:
            for logger_name in _BACKGROUND_FAILURES:
                logging.getLogger(logger_name).removeFilter(watch)
            self._end_stage(name, status)

    def _end_stage(self, name: str, status: str) -> None:
        """Flush what the trainer's callback queued and end the active stage run; after the server
        went away, only end it locally (MLflow's stack), leaving it for the next run to close."""
        import mlflow  # heavy: deferred until needed

        try:
            if self.lost is None:
                flush_async_logging()
                mlflow.end_run(status)
                return
        except Exception as exc:
            if not self.went_away(name, exc):
                raise
        if mlflow.active_run() is not None:
            with contextlib.suppress(Exception), _no_retries():
                mlflow.end_run(status)  # pops MLflow's stack first, then fails to reach the server

    def record_cached_stage(
        self,
        name: str,
        *,
        kind: str | None = None,
        producer_run_id: str | None = None,
        cache_key: str | None = None,
    ) -> StageRun:
        """A finished nested run for a stage served from cache: ``cached=true``, ``cached_from_run_id``.

        The producer is found from ``cache_key`` when not given. Its metrics (full histories), config
        params (``stage.*``, ``eval.*``, ...: :func:`param_prefix`; an evaluation's ``dataset.*``)
        and inputs (datasets, the evaluated model) are copied, so comparisons, plots and the run page
        treat the stage like one that ran.
        """
        if not self.enabled:
            return StageRun(name)
        client = mlflow_client(self.tracking_uri)
        producer_run_id = producer_run_id or (self.find_producer(cache_key) if cache_key else None)
        tags = {"mlflow.parentRunId": self.run_id, STEP_TAG: name, "cached": "true"}
        if kind:
            tags[STEP_KIND_TAG] = kind
        if producer_run_id:
            tags["cached_from_run_id"] = producer_run_id
        run = client.create_run(self.experiment_id, run_name=name, tags=tags)
        stage = StageRun(name, run.info.run_id, self.run_id, self.tracking_uri)
        if producer_run_id:
            latest = copy_metric_history(client, producer_run_id, stage.run_id)
            mirror_eval(client, self.run_id, name, latest)
            producer = client.get_run(producer_run_id)
            send_params(client, stage.run_id, _config_params(producer.data.params, kind))
            _copy_inputs(client, producer, stage.run_id)
        else:
            logger.info("stage %s: served from cache, but no finished MLflow run produced it", name)
        client.set_terminated(stage.run_id, "FINISHED")
        return stage

    def find_producer(self, cache_key: str) -> str | None:
        """Id of the latest finished run tagged with ``cache_key``: this experiment first, then any."""
        if not self.enabled:
            return None
        client = mlflow_client(self.tracking_uri)
        query = f"tags.`{CACHE_KEY_TAG}` = '{cache_key}' and attributes.status = 'FINISHED'"
        everywhere = [e.experiment_id for e in client.search_experiments()]
        for ids in ([self.experiment_id], everywhere):
            runs = client.search_runs(ids, query, order_by=["attributes.start_time DESC"], max_results=1)
            if runs:
                return runs[0].info.run_id
        return None

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Metrics on the parent run (pipeline totals: duration, final accuracy)."""
        if self.enabled:
            send_metric_values(mlflow_client(self.tracking_uri), self.run_id, metrics, step)

    def log_stage_model(
        self,
        stage: StageRun,
        *,
        kind: str | None = None,
        output_dir: str | Path | None = None,
        cache_key: str | None = None,
        params: Mapping[str, str] | None = None,
    ) -> str | None:
        """A lightweight LoggedModel for a stage output: tags naming it and ``stage.json``; returns its id.

        See :mod:`posttrain.tracking.logged_models`. None when tracking is off.
        """
        if not (self.enabled and stage.enabled):
            return None
        client = mlflow_client(self.tracking_uri)
        model = create_stage_model(
            client,
            self.experiment_id,
            stage=stage.name,
            kind=kind,
            source_run_id=stage.run_id,
            pipeline_run_id=self.run_id,
            config_name=self.config_name or "",
            output_dir=output_dir,
            cache_key=cache_key,
            params=params,
        )
        stage_json = Path(output_dir, "stage.json") if output_dir else None
        try:
            if stage_json is not None and stage_json.is_file():
                client.log_model_artifact(model.model_id, str(stage_json))
        except Exception:
            client.finalize_logged_model(model.model_id, "FAILED")
            raise
        client.finalize_logged_model(model.model_id, "READY")
        return model.model_id

    def link_stage_model(self, stage: StageRun, model_id: str, *, final: bool, linked: bool = False) -> None:
        """Show ``model_id`` as the output of the stage's run (a cached copy's too) and, for the
        plan's last training stage, of the pipeline run: the run pages' "Logged models" then name
        what each run produced, the pipeline run's its final model. ``linked``: the model came from
        :meth:`log_final_model`, whose ``log_model`` linked it to the stage's run already."""
        if not (self.enabled and stage.enabled):  # a disabled stage run: tracking was lost
            return
        client = mlflow_client(self.tracking_uri)
        if not linked:
            link_model_output(client, stage.run_id, model_id)
        if final:
            link_model_output(client, self.run_id, model_id)

    def find_stage_model(self, cache_key: str) -> str | None:
        """The LoggedModel produced under ``cache_key`` (this experiment first, then any), or None."""
        if not self.enabled:
            return None
        client = mlflow_client(self.tracking_uri)
        found = find_stage_model(client, [self.experiment_id], cache_key)
        if found is None:
            everywhere = [e.experiment_id for e in client.search_experiments()]
            found = find_stage_model(client, everywhere, cache_key)
        return found

    def log_final_model(
        self,
        model_dir: str | Path,
        *,
        base_model_path: str | Path | None = None,
        name: str = "model",
        stage: StageRun | None = None,
        kind: str | None = None,
        cache_key: str | None = None,
        params: Mapping[str, str] | None = None,
    ) -> str | None:
        """Log a model directory with ``mlflow.transformers.log_model``; returns its ``models:/`` URI.

        With ``stage`` it is that stage's LoggedModel (named after the stage, produced by its run,
        tagged like :meth:`log_stage_model`'s references); without, it hangs off the pipeline run.
        ``params`` default to the pipeline run's (the flattened config).

        The model is loaded and passed as model + tokenizer: MLflow's path-only route (log a
        checkpoint without loading it) fails on transformers 5.24 (``check_task`` returns the
        pipeline class by name). A PEFT adapter directory needs ``base_model_path`` (a full model
        directory): without it MLflow silently drops a local base; with it only the adapter is
        stored and the base is referenced by path. Requirements are explicit because MLflow's
        defaults include torchvision, which is absent. None when tracking or ``tracking.log_model``
        is off.
        """
        if not (self.enabled and self.log_models):
            return None
        import mlflow  # heavy: deferred until needed
        from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: deferred until needed

        model_dir = Path(model_dir)
        adapter = (model_dir / "adapter_config.json").is_file()
        has_tokenizer = any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
        extra: dict[str, Any] = {}
        if not adapter:
            model = AutoModelForCausalLM.from_pretrained(model_dir)
        else:
            if base_model_path is None or (Path(base_model_path) / "adapter_config.json").is_file():
                raise ValueError(
                    f"{model_dir} is a PEFT adapter: pass base_model_path (a full model "
                    "directory, not another adapter; merge chained adapters first)"
                )
            from peft import PeftModel  # heavy: deferred until needed

            model = PeftModel.from_pretrained(
                AutoModelForCausalLM.from_pretrained(base_model_path), str(model_dir)
            )
            extra["base_model_path"] = str(base_model_path)
        tokenizer = AutoTokenizer.from_pretrained(
            model_dir if has_tokenizer or not adapter else base_model_path
        )
        # Created first so it lands in this experiment: log_model alone files a model under the
        # thread's active experiment, which for our never-active parent run is "Default".
        self._use_uri()
        client = mlflow_client(self.tracking_uri)
        if params is None:
            params = client.get_run(self.run_id).data.params
        source_run_id = stage.run_id if stage is not None and stage.enabled else self.run_id
        logged = create_stage_model(
            client,
            self.experiment_id,
            stage=stage.name if stage is not None else name,
            kind=kind,
            source_run_id=source_run_id,
            pipeline_run_id=self.run_id,
            config_name=self.config_name or "",
            output_dir=model_dir,
            cache_key=cache_key,
            params=params,
            content="weights",
        )
        try:
            with _without_local_model_notices():
                info = mlflow.transformers.log_model(
                    {"model": model, "tokenizer": tokenizer},
                    task="text-generation",
                    model_id=logged.model_id,
                    run_id=source_run_id,
                    pip_requirements=model_requirements(peft=adapter),
                    **extra,
                )
        except Exception:
            client.finalize_logged_model(logged.model_id, "FAILED")
            raise
        client.set_tag(self.run_id, "posttrain.model_uri", info.model_uri)
        return info.model_uri

    def plot_accuracy_by_stage(self, metric_filter: str = "accuracy") -> bool:
        """``accuracy_by_stage.png`` on the parent, from the ``eval/*`` metrics of its stage runs
        (every evaluation set's, not per number of operations)."""
        if not self.enabled:
            return False
        client = mlflow_client(self.tracking_uri)
        per_stage = {
            s: {
                k: v
                for k, v in m.items()
                if metric_filter in k and parse_metric_name(k)[2] is None and not is_interval_metric(k)
            }
            for s, m in eval_metrics_by_stage(client, self.experiment_id, self.run_id).items()
        }
        per_stage = {s: m for s, m in per_stage.items() if m}
        if not per_stage:
            return False
        client.log_figure(self.run_id, accuracy_by_stage_figure(per_stage), "accuracy_by_stage.png")
        return True

    def log_stage_gains(self) -> bool:
        """``stage_gains.json`` on the parent: the rows ``posttrain compare`` heads its table with
        (each evaluation's accuracy with its interval, its change from the evaluation before it with
        the paired interval, the minutes that bought it), so the UI shows what each stage bought
        without a search through the run's few hundred metric names."""
        if not self.enabled:
            return False
        import pandas as pd  # heavy: deferred until needed

        client = mlflow_client(self.tracking_uri)
        run = client.get_run(self.run_id)
        metrics = {k: v for k, v in run.data.metrics.items() if "/" in k}
        names = in_plan_order(metrics, [run.data.tags.get(STEPS_TAG, "")])
        rows = format_headline([metrics], names)
        if not rows:
            return False
        table = pd.DataFrame({"what": [label.strip() for label, _ in rows], "value": [v[0] for _, v in rows]})
        client.log_table(self.run_id, table, "stage_gains.json")
        return True

    def finish(self, status: str = "FINISHED") -> None:
        """End the parent run and restore the tracking URI that was set before this run."""
        if self.run_id is None or self._finished:
            return
        import mlflow  # heavy: deferred until needed

        if self.lost is None:  # else the next run on this store closes it (close_abandoned_runs)
            with contextlib.suppress(Exception):
                flush_async_logging()
            try:
                mlflow_client(self.tracking_uri).set_terminated(self.run_id, status)
            except Exception as exc:
                if not self.went_away("the end of the run", exc):
                    raise
        # set_tracking_uri(None) clears both the global and $MLFLOW_TRACKING_URI.
        mlflow.set_tracking_uri(self._previous_uri)  # type: ignore[arg-type]
        self._finished = True  # a second finish (or __exit__ after finish) is harmless


def model_requirements(peft: bool = False) -> list[str]:
    """Pinned requirements of a logged model, from this environment (local version labels dropped)."""
    names = ["mlflow", "torch", "transformers", "accelerate", "tokenizers", "safetensors"] + (
        ["peft"] if peft else []
    )
    return [f"{n}=={v.split('+')[0]}" for n, v in package_versions(names, include_missing=False).items()]


def start_pipeline_run(
    cfg: PipelineConfig,
    *,
    run_name: str | None = None,
    run_tags: Mapping[str, str] | None = None,
    steps: Sequence[str] = (),
    store: str | None = None,
    close_abandoned: bool = True,
) -> Tracker:
    """Create the experiment (if needed) and the parent run; a disabled Tracker when tracking is off.

    The parent gets tags (config hash and name, git commit, package versions, the plan's ``steps``
    in order, the ``store`` it writes), ``config.yaml`` and the flattened resolved config as params.
    MLflow's own variables are honoured: the experiment is ``tracking.experiment``, else
    ``$MLFLOW_EXPERIMENT_NAME`` / ``$MLFLOW_EXPERIMENT_ID``, else the config's name; and under an
    outer run (``$MLFLOW_RUN_ID``, or this thread's active run) the pipeline run is nested in it, in
    its experiment, and the outer run is left running. Use as a context manager or call ``finish()``.
    Call it holding the store's lock: runs of this store that are still ``RUNNING`` then belong to a
    run that was killed, and are marked ``KILLED`` first (unless ``close_abandoned`` is false: a
    sweep's point, whose sweep closed them once before its points started).
    """
    if not cfg.tracking.enabled:
        return Tracker()
    import mlflow  # heavy: deferred until needed

    uri = resolve_tracking_uri(cfg.tracking)
    prompt_async_flush()
    previous = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    client = mlflow_client(uri)
    outer = _outer_run(client, uri)
    if outer is not None:
        experiment_id = outer.info.experiment_id
    elif not cfg.tracking.experiment and os.environ.get("MLFLOW_EXPERIMENT_ID"):
        experiment_id = _experiment_by_id(client, os.environ["MLFLOW_EXPERIMENT_ID"])
    else:
        experiment_id = _get_or_create_experiment(client, experiment_name(cfg), uri)
    if store is not None and close_abandoned:
        _close_abandoned(client, store)
    tags = {
        **({STORE_TAG: store} if store is not None else {}),
        ROLE_TAG: "pipeline",
        SEED_GROUP_TAG: seed_group(cfg),
        "posttrain.config_name": cfg.name,
        "posttrain.config_hash": stable_hash(cache_form(cfg)),
        **{
            f"posttrain.version.{k}": v
            for k, v in package_versions(TRACKED_PACKAGES, include_missing=False).items()
        },
    }
    if commit := git_commit():
        tags.update({"posttrain.git_commit": commit, "mlflow.source.git.commit": commit})
    if steps:
        tags[STEPS_TAG] = ",".join(steps)
    tags.update(run_tags or {})
    if outer is not None:
        tags["mlflow.parentRunId"] = outer.info.run_id
        logger.info("nesting the pipeline run under the outer MLflow run %s", outer.info.run_id)
    # SQL stores hold a run's name in 250 characters: a sweep point named after many keys is cut.
    run = client.create_run(experiment_id, run_name=truncate(run_name or cfg.name, 250), tags=tags)
    tracker = Tracker(
        True,
        uri,
        experiment_id,
        run.info.run_id,
        cfg.tracking.log_model,
        previous,
        config_name=cfg.name,
        system_metrics=cfg.tracking.system_metrics,
        experiment_name=client.get_experiment(experiment_id).name,
    )
    try:
        client.log_text(tracker.run_id, dump_config(cfg), "config.yaml")
        send_params(client, tracker.run_id, flatten_params(cfg))
    except Exception:
        tracker.finish("FAILED")
        raise
    logger.info(
        "MLflow run %s in experiment %r at %s", tracker.run_id, tracker.experiment_name, redact_text(uri)
    )
    return tracker


def close_abandoned_runs(cfg: PipelineConfig, store: str) -> list[str]:
    """Mark ``KILLED`` the MLflow runs a killed run of ``store`` left ``RUNNING`` (see
    :func:`_close_abandoned`); nothing when tracking is off."""
    if not cfg.tracking.enabled:
        return []
    return _close_abandoned(mlflow_client(resolve_tracking_uri(cfg.tracking)), store)


def _close_abandoned(client: Any, store: str) -> list[str]:
    """Mark ``KILLED`` the pipeline runs of ``store`` left ``RUNNING`` by a killed process, and their
    stage runs; returns their ids. Only safe under the store's lock (no live run of it exists then);
    runs of other stores sharing the tracking database are left alone."""
    if "'" in store:  # cannot be quoted in a filter string; leave such runs as they are
        return []
    experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return []
    query = f"tags.`{STORE_TAG}` = '{store}' and attributes.status = 'RUNNING'"
    closed = []
    for parent in client.search_runs(experiments, query, max_results=1000):
        children = client.search_runs(
            experiments,
            f"tags.mlflow.parentRunId = '{parent.info.run_id}' and attributes.status = 'RUNNING'",
            max_results=1000,
        )
        for run in [*children, parent]:
            client.set_terminated(run.info.run_id, "KILLED")
            closed.append(run.info.run_id)
    if closed:
        logger.warning("marked %d MLflow run(s) of an interrupted run of %s KILLED", len(closed), store)
    return closed


def open_tracking_store(cfg: PipelineConfig) -> None:
    """Import MLflow and open (on first use: create and migrate) the tracking store now.

    Both cost 2-4 s on 2 cores. The CLI calls this while Prefect's embedded server boots in its
    own process, so the two overlap; MLflow caches the store per URI, so the pipeline run that
    follows reuses it. Nothing is logged.
    """
    if cfg.tracking.enabled:
        mlflow_client(resolve_tracking_uri(cfg.tracking))


def _outer_run(client: Any, uri: str) -> Any | None:
    """The run posttrain was started under: ``$MLFLOW_RUN_ID`` (as ``mlflow run`` and MLflow users
    set it), else this thread's active run. A variable naming no run is a one-line error."""
    import mlflow  # heavy: deferred until needed
    from mlflow.exceptions import MlflowException  # heavy: deferred until needed

    run_id = os.environ.get("MLFLOW_RUN_ID")
    if not run_id:
        active = mlflow.active_run()
        return client.get_run(active.info.run_id) if active is not None else None
    try:
        return client.get_run(run_id)
    except MlflowException:
        raise ConfigError(
            f"MLFLOW_RUN_ID={run_id}: no such run at {uri} (unset it or point it at a run)"
        ) from None


def _experiment_by_id(client: Any, experiment_id: str) -> str:
    from mlflow.exceptions import MlflowException  # heavy: deferred until needed

    try:
        return client.get_experiment(experiment_id).experiment_id
    except MlflowException:
        raise ConfigError(f"MLFLOW_EXPERIMENT_ID={experiment_id}: no such experiment") from None


EXPERIMENT_KIND = {"mlflow.experimentKind": "custom_model_development"}
"""MLflow's UI opens an experiment without this tag in its GenAI mode ("Agent versions"); with it, as
model training: runs, and the Models tab a training user expects."""


def _get_or_create_experiment(client: Any, name: str, uri: str) -> str:
    """Existing (restored if deleted) or new experiment, marked as model training unless it says
    otherwise; a SQLite store keeps artifacts next to its DB."""
    from mlflow.exceptions import MlflowException  # heavy: deferred until needed

    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        if experiment.lifecycle_stage == "deleted":
            logger.warning("restoring deleted MLflow experiment %r", name)
            client.restore_experiment(experiment.experiment_id)
        if not any(key in experiment.tags for key in EXPERIMENT_KIND):
            for key, value in EXPERIMENT_KIND.items():
                client.set_experiment_tag(experiment.experiment_id, key, value)
        return experiment.experiment_id
    db = sqlite_path(uri)
    location = (db.parent / "mlruns").resolve().as_uri() if db is not None else None
    try:
        return client.create_experiment(name, artifact_location=location, tags=EXPERIMENT_KIND)
    except MlflowException:  # created concurrently by another process
        return client.get_experiment_by_name(name).experiment_id
