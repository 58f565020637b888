"""One nested MLflow run per pipeline step: what a step logs (params, metrics, data, evals, samples)."""

from __future__ import annotations

import json
import logging
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.core.config import PassRateConfig
from posttrain.core.hashing import jsonable
from posttrain.core.redact import redact, redact_text
from posttrain.data.pass_rates import PassRates, kept_ids
from posttrain.tracking.compare import (
    cell_text,
    is_curve_metric,
    last_user_text,
    pass_rate_figure,
    reward_curves_figure,
    reward_series,
)
from posttrain.tracking.mlflow_io import (
    MAX_TAG_LENGTH,
    flatten_params,
    flush_async_logging,
    metric_batch,
    mirror_eval,
    mlflow_client,
    retry_dataset_race,
    safe_key,
    send_metric_batch,
    send_metric_values,
    send_params,
    truncate,
)

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------- stage runs


def _eval_dataset(
    records: Sequence[Mapping[str, Any]], name: str, info: Mapping[str, Any] | None = None
) -> Any | None:
    """The evaluated examples (ids, questions, gold answers) as an MLflow dataset; its digest is
    their content's, so two evaluations on the same questions share it. Its source is the hub split
    or the local file ``info`` (the report's ``dataset``) names. None without records."""
    if not records:
        return None
    import mlflow.data  # heavy: deferred until needed
    import pandas as pd

    columns = [c for c in ("id", "question", "gold") if c in records[0]]
    frame = pd.DataFrame([{c: str(r.get(c)) for c in columns} for r in records])
    with warnings.catch_warnings():  # schema inference warns about column types as if for a model
        warnings.simplefilter("ignore", UserWarning)
        return mlflow.data.from_pandas(frame, name=name, source=_dataset_source(info or {}))


def _dataset_source(info: Mapping[str, Any]) -> Any:
    """MLflow's record of where evaluation questions came from: a hub split, a local file, or (None)
    the code that made them (a held-out slice, generated problems)."""
    if info.get("source") == "hub":
        from mlflow.data.huggingface_dataset_source import HuggingFaceDatasetSource

        return HuggingFaceDatasetSource(str(info.get("dataset")), split=str(info.get("split")))
    if info.get("source") == "local":
        from mlflow.data.dataset_source_registry import resolve_dataset_source

        # MLflow registers its local-file source twice, and warns that a path matches both.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return resolve_dataset_source(str(info.get("dataset")))
    return None


def _clip(value: Any, limit: int) -> Any:
    """Long texts shortened for the UI table; numbers and missing cells (None) kept as they are."""
    return truncate(value, limit) if isinstance(value, str) else value


@dataclass
class StageRun:
    """One nested run. Every method is a no-op when ``run_id`` is None (tracking disabled).

    All writes use the run id explicitly, so helpers may be called from any thread and even after
    the stage's ``with`` block has closed the run.
    """

    name: str
    run_id: str | None = None
    parent_run_id: str | None = None
    tracking_uri: str | None = None

    @property
    def enabled(self) -> bool:
        return self.run_id is not None

    @property
    def report_to(self) -> list[str] | str:
        """What to pass as TRL's ``report_to``: the callback then logs into this (active) run."""
        return ["mlflow"] if self.enabled else "none"

    @property
    def _client(self) -> Any:
        return mlflow_client(self.tracking_uri)

    def log_params(self, section: Any, prefix: str = "stage") -> None:
        """The stage's resolved config section, flattened under ``stage.`` (clear of the callback's keys)."""
        if self.enabled:
            send_params(self._client, self.run_id, flatten_params(section, prefix))

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Numeric values only (text and None are skipped); bools log as 0/1."""
        if self.enabled:
            send_metric_values(self._client, self.run_id, metrics, step)
            mirror_eval(self._client, self.parent_run_id, self.name, metrics)

    def log_history(self, rows: Sequence[Mapping[str, Any]], step_key: str = "step") -> None:
        """Per-step metrics from log dicts (a trainer's ``log_history``, ``log_history.jsonl``), in one batch.

        For stages whose trainer did not report to MLflow itself (or to replay a saved history).
        """
        if not self.enabled:
            return
        batch = [
            metric
            for index, row in enumerate(rows)
            for metric in metric_batch(
                {k: v for k, v in row.items() if k != step_key}, int(row.get(step_key, index))
            )
        ]
        send_metric_batch(self._client, self.run_id, batch)
        mirror_eval(self._client, self.parent_run_id, self.name, {m.key: m.value for m in batch})

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self.enabled:
            from mlflow.entities import RunTag  # heavy: deferred until needed

            batch = [
                RunTag(safe_key(k), truncate(redact_text(str(v)), MAX_TAG_LENGTH))
                for k, v in redact(tags).items()
            ]
            self._client.log_batch(self.run_id, tags=batch)

    def log_stage_json(self, data: Mapping[str, Any]) -> None:
        """``stage.json`` as an artifact: what produced the stage output, readable without the store."""
        if self.enabled:
            self._client.log_dict(self.run_id, jsonable(redact(dict(data))), "stage.json")

    def log_dataset(
        self,
        dataset: Any,
        name: str,
        context: str = "training",
        *,
        digest: str | None = None,
        hub_path: str | None = None,
        source: str | None = None,
    ) -> None:
        """Data lineage: a ``datasets.Dataset`` (or a DataFrame) as a run input.

        The digest defaults to the dataset's own ``_fingerprint`` (it changes with every transform), so
        two runs trained on the same rows show the same digest. ``hub_path`` records a hub source;
        ``source`` (a file, ``synthetic(seed=0)``) is kept as an input tag.
        """
        if not self.enabled:
            return
        import mlflow.data
        from mlflow.entities import Dataset, DatasetInput, InputTag  # heavy: deferred until needed

        digest = (digest or getattr(dataset, "_fingerprint", None) or "")[:36] or None
        with warnings.catch_warnings():  # schema inference warns about int columns as if for a model
            warnings.simplefilter("ignore", UserWarning)
            if hasattr(dataset, "to_pandas") and not hasattr(dataset, "iloc"):
                ds = mlflow.data.from_huggingface(dataset, path=hub_path, name=name, digest=digest)
            else:
                ds = mlflow.data.from_pandas(dataset, name=name, digest=digest)
            entity = Dataset(**ds.to_dict())  # to_dict infers the schema, which warns too
        tags = [InputTag("mlflow.data.context", context)]
        if source:
            tags.append(InputTag("posttrain.source", truncate(source, 500)))
        inputs = [DatasetInput(entity, tags)]
        retry_dataset_race(lambda: self._client.log_inputs(self.run_id, inputs))

    def log_eval(
        self,
        summary: Mapping[str, Any],
        records: Sequence[Mapping[str, Any]] = (),
        prefix: str = "eval/",
        *,
        model_id: str | None = None,
        dataset_name: str = "eval",
        table: str = "eval_examples",
        data_info: Mapping[str, Any] | None = None,
    ) -> None:
        """Summary metrics as ``eval/<m>`` (mirrored to the parent as ``<stage>/<m>``) and per-example rows.

        With ``model_id`` the metrics are logged against that LoggedModel (the evaluated stage's)
        and the evaluation set, a dataset named ``dataset_name`` built from the records' ids and
        questions, so the model view compares models on the same data. Rows go to ``<table>.json``
        (``log_table``, for the UI; reading it back with ``mlflow.load_table`` re-infers types, e.g.
        ``"4"`` becomes 4) and ``<table>.jsonl`` (exact round trip); ``table`` may name a folder
        (``gsm8k/eval_examples``), one per evaluation set. ``data_info`` (the report's ``dataset``:
        source, dataset, split, size) is logged as params ``dataset.<dataset_name>.<field>`` and is
        the MLflow dataset's source.
        """
        if not self.enabled:
            return
        metrics = {f"{prefix}{k}": v for k, v in summary.items()}
        if data_info:
            fields = {k: v for k, v in data_info.items() if isinstance(v, str | int)}
            send_params(self._client, self.run_id, flatten_params(fields, f"dataset.{dataset_name}"))
        dataset = _eval_dataset(records, dataset_name, data_info)
        if model_id is None:  # the input model (a baseline): the set is the run's input all the same
            self.log_metrics(metrics)
            if dataset is not None:
                from mlflow.entities import DatasetInput  # heavy: deferred until needed

                inputs = [DatasetInput(dataset._to_mlflow_entity(), tags=[])]  # as log_metrics links it
                retry_dataset_race(lambda: self._client.log_inputs(self.run_id, datasets=inputs))
        else:
            self._log_model_metrics(metrics, model_id, dataset)
        if records:
            import pandas as pd

            rows = jsonable([dict(r) for r in records])
            self._client.log_table(self.run_id, pd.DataFrame(rows), f"{table}.json")
            self._client.log_text(
                self.run_id, "\n".join(json.dumps(r) for r in rows) + "\n", f"{table}.jsonl"
            )

    def _log_model_metrics(self, metrics: Mapping[str, Any], model_id: str, dataset: Any) -> None:
        """``mlflow.log_metrics(..., model_id=, dataset=)`` into this run (links the model and the
        dataset as run inputs too), and the parent's ``<stage>/<m>`` mirror."""
        import mlflow  # heavy: deferred until needed

        if mlflow.get_tracking_uri() != self.tracking_uri:
            mlflow.set_tracking_uri(self.tracking_uri)
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        # MLflow links the dataset (log_inputs) before it logs any metric: a retry logs each once.
        retry_dataset_race(
            lambda: mlflow.log_metrics(
                numeric, run_id=self.run_id, model_id=model_id, dataset=dataset, synchronous=True
            )
        )
        mirror_eval(self._client, self.parent_run_id, self.name, numeric)

    def log_completions(self, directory: str | Path, max_chars: int = 4000) -> int:
        """TRL's ``completions/*.parquet`` (``log_completions=True``) as one ``completions.json`` table.

        ``directory`` is the trainer's output dir or its ``completions`` folder. The raw parquet
        files are kept under ``completions/``; chat-format cells become text so the table renders.
        Returns the number of rows logged.
        """
        folder = Path(directory)
        folder = folder / "completions" if (folder / "completions").is_dir() else folder
        files = sorted(folder.glob("*.parquet"))
        if not self.enabled or not files:
            return 0
        import pandas as pd

        table = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
        if "prompt" in table.columns and (questions := table["prompt"].map(last_user_text)).notna().any():
            table.insert(int("step" in table.columns), "question", questions)  # before the system prompt
        for column in table.columns:
            if table[column].dtype == object:
                table[column] = table[column].map(lambda cell: _clip(cell_text(cell), max_chars))
        self._client.log_table(self.run_id, table, "completions.json")
        for f in files:
            self._client.log_artifact(self.run_id, str(f), "completions")
        return len(table)

    def log_alerts(self, alerts: Sequence[Any]) -> None:
        """Health alerts: ``alert.<kind>`` tags (searchable, shown in the runs table) + ``alerts.json``.

        Accepts dicts or objects with ``as_dict()`` (``training.health.Alert``); a kind that fired
        several times keeps its first message in the tag and a count.
        """
        rows = [a.as_dict() if hasattr(a, "as_dict") else dict(a) for a in alerts]
        if not self.enabled or not rows:
            return
        tags: dict[str, str] = {"alerts.count": str(len(rows))}
        for kind in dict.fromkeys(r.get("kind", "unknown") for r in rows):
            same = [r for r in rows if r.get("kind", "unknown") == kind]
            more = f" (+{len(same) - 1} more)" if len(same) > 1 else ""
            tags[f"alert.{kind}"] = f"step {same[0].get('step')}: {same[0].get('message', '')}{more}"
        self.set_tags(tags)
        self._client.log_dict(self.run_id, {"alerts": jsonable(rows)}, "alerts.json")
        if self.parent_run_id:  # visible from the pipeline run too: which stage raised what
            kinds = ",".join(k.removeprefix("alert.") for k in tags if k.startswith("alert."))
            self._client.set_tag(self.parent_run_id, safe_key(f"alerts.{self.name}"), kinds)

    def log_pass_rates(
        self, rates: PassRates, pass_rate: PassRateConfig, questions: Mapping[str, str]
    ) -> None:
        """A scoring step's pass rates: ``pass_rates.png`` (prompts by correct completions, the kept
        ones in colour), the ``pass_rates`` table (one row per prompt) and ``kept``/``kept_share``
        under the stage's current band (``pass_rate``)."""
        if not self.enabled:
            return
        import pandas as pd

        kept = set(kept_ids(rates, pass_rate))
        self.log_metrics({"kept": len(kept), "kept_share": len(kept) / max(1, len(rates.correct))})
        title = f"{self.name}: pass rates of {len(rates.correct)} prompts ({len(kept)} kept)"
        figure = pass_rate_figure(rates.histogram(), pass_rate.band, title)
        self._client.log_figure(self.run_id, figure, "pass_rates.png")
        rows = [
            {
                "id": pid,
                "question": cell_text(questions.get(pid, "")),
                "correct": n,
                "pass_rate": rates.rate(pid),
                "kept": pid in kept,
            }
            for pid, n in rates.correct.items()
        ]
        self._client.log_table(self.run_id, pd.DataFrame(rows), "pass_rates.json")

    def plot_rewards(self, history: Sequence[Mapping[str, Any]] | None = None) -> bool:
        """``reward_curves.png``: ``reward``, each ``rewards/<fn>/mean`` and ``eval/accuracy`` by step.

        Without ``history`` the curves are read back from this run's logged metrics (what the
        callback wrote). Returns False when there was nothing to plot.
        """
        if not self.enabled:
            return False
        curves = reward_series(history) if history is not None else self._reward_history()
        if not curves:
            return False
        title = f"{self.name}: rewards" + (" and held-out accuracy" if "eval/accuracy" in curves else "")
        fig = reward_curves_figure(curves, title=title)
        self._client.log_figure(self.run_id, fig, "reward_curves.png")
        return True

    def _reward_history(self) -> dict[str, list[tuple[int, float]]]:
        flush_async_logging()  # the callback logs asynchronously
        client = self._client
        keys = [k for k in client.get_run(self.run_id).data.metrics if is_curve_metric(k)]
        return {
            k: [(m.step, m.value) for m in client.get_metric_history(self.run_id, k)] for k in sorted(keys)
        }
