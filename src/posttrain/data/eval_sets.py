"""Where evaluation questions come from: GSM8K test (hub), a local file, a held-out slice, synthetic.

Numbers are only comparable across runs (baseline vs. each stage, today vs. last week) when they
are computed on the same questions, so ``limit N`` always takes the *first* N records in the
source's fixed order (file order, hub row order, generation order), never a random sample, and ids
are stable (see :mod:`posttrain.core.gsm8k`).

Synthetic evaluation problems use their own seed, far from the training generator's defaults, so a
synthetic eval never re-uses the exact problems a synthetic training run saw.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from posttrain.core.errors import DataError
from posttrain.data.sources import load_hub, load_jsonl
from posttrain.data.synthetic import generate_problems

logger = logging.getLogger(__name__)

__all__ = [
    "SYNTHETIC_EVAL_SEED",
    "SYNTHETIC_EVAL_SIZE",
    "eval_records_for",
    "eval_set_info",
    "load_eval_records",
    "parse_data_arg",
]

SYNTHETIC_EVAL_SEED = 1_000_003
"""Seed of the synthetic eval set, apart from the training problems' (``data.seed``, default 0)."""
SYNTHETIC_EVAL_SIZE = 200
"""How many synthetic problems to evaluate when no limit is given."""


def load_eval_records(
    source: str,
    *,
    path: str | Path | None = None,
    heldout: Sequence[dict[str, Any]] | None = None,
    limit: int | None = None,
    hub_id: str = "openai/gsm8k",
    hub_config: str = "main",
    hub_split: str = "test",
    synthetic_ops: tuple[int, int] = (1, 4),
    synthetic_seed: int = SYNTHETIC_EVAL_SEED,
    synthetic_numbers: str = "default",
    synthetic_themes: Sequence[str] | None = None,
) -> list[dict[str, Any]]:
    """The first ``limit`` evaluation records (``id, question, answer, ...``) of one source.

    ``source`` is ``hub`` (GSM8K ``hub_split``, default the test split), ``local`` (``path``: a
    GSM8K-format ``.jsonl`` file or folder), ``heldout`` (the ``heldout`` records the caller split
    off the training data) or ``synthetic`` (generated, ``synthetic_ops`` operations each, numbers of
    size ``synthetic_numbers``, from the stories ``synthetic_themes``).
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 or None, got {limit}")
    if source == "hub":
        records = load_hub(hub_id, hub_config, hub_split, limit=limit).records
    elif source == "local":
        if path is None:
            raise DataError("eval data 'local' needs a path to a GSM8K .jsonl file or folder")
        records = load_jsonl(path, limit=limit).records
    elif source == "heldout":
        if heldout is None:
            raise DataError("eval data 'heldout' needs the held-out records (split off the training data)")
        records = list(heldout[:limit] if limit is not None else heldout)
    elif source == "synthetic":
        low, high = synthetic_ops
        records = generate_problems(
            limit or SYNTHETIC_EVAL_SIZE,
            low,
            high,
            seed=synthetic_seed,
            numbers=synthetic_numbers,
            themes=synthetic_themes,
        )
    else:
        raise DataError(f"unknown eval data source {source!r} (expected hub, local, heldout or synthetic)")
    if not records:
        where = {"local": f"{path}: ", "hub": f"{hub_id} ({hub_split}): "}.get(source, "")
        raise DataError(f"{where}no evaluation records (eval data source {source!r})")
    logger.info("evaluating on %d %s records", len(records), source)
    return records


def eval_set_info(
    source: str,
    count: int,
    *,
    path: str | Path | None = None,
    hub_id: str = "openai/gsm8k",
    hub_split: str = "test",
    synthetic_ops: tuple[int, int] = (1, 4),
    synthetic_themes: Sequence[str] | None = None,
    trained_on: str | None = None,
) -> dict[str, Any]:
    """What an evaluation set's ``count`` questions are, as a report and MLflow name them: the
    source, the dataset and split they come from, and for a local file how many records the split
    holds. A number is only comparable with another taken on the same split, and GSM8K's is always
    reported on its test split: the label says which one a number is.

    ``trained_on`` names the training data a ``heldout`` slice was cut from; ``synthetic_themes``
    the stories generated questions were limited to.

    >>> eval_set_info("hub", 200)["label"]
    'openai/gsm8k test split, 200 questions'
    >>> eval_set_info("heldout", 100, trained_on="data/gsm8k/train.jsonl")["label"]
    'dev slice held out of data/gsm8k/train.jsonl (never trained on), 100 questions'
    >>> eval_set_info("synthetic", 50, synthetic_ops=(1, 3), synthetic_themes=["farm", "travel"])["label"]
    'synthetic problems of 1-3 operations (farm, travel), 50 questions'
    """
    total = None
    if source == "hub":
        dataset, split = hub_id, hub_split
    elif source == "local":
        dataset = str(path)
        split = Path(dataset).stem if Path(dataset).suffix else Path(dataset).name
        total = len(load_jsonl(dataset).records)
    elif source == "heldout":
        dataset, split = trained_on or "the training data", "dev"
    else:
        low, high = synthetic_ops
        dataset, split = "posttrain synthetic", f"{low}-{high} operations"
        if synthetic_themes:
            split += f" ({', '.join(synthetic_themes)})"
    if source == "heldout":
        label = f"dev slice held out of {dataset} (never trained on)"
    elif source == "synthetic":
        label = f"synthetic problems of {split}"
    else:
        label = f"{dataset} {split} split"
    label += f", {count:,} of {total:,} questions" if total and total != count else f", {count:,} questions"
    info: dict[str, Any] = {"source": source, "dataset": dataset, "split": split, "num_questions": count}
    if total is not None:
        info["split_size"] = total
    return info | {"label": label}


def parse_data_arg(data: str, hub_split: str = "test") -> dict[str, str]:
    """The CLI's ``--data`` string as EvalConfig fields: ``hub``, ``hub:<split>``, ``synthetic`` or a path.

    >>> parse_data_arg("hub:train"), parse_data_arg("synthetic"), parse_data_arg("test.jsonl")
    ({'data': 'hub', 'hub_split': 'train'}, {'data': 'synthetic'}, {'data': 'local', 'path': 'test.jsonl'})
    """
    if data == "synthetic":
        return {"data": "synthetic"}
    if data == "hub" or data.startswith("hub:"):
        return {"data": "hub", "hub_split": data.partition(":")[2] or hub_split}
    return {"data": "local", "path": data}


def eval_records_for(data: str, limit: int | None = None, hub_split: str = "test") -> tuple[str, list[dict]]:
    """Resolve the CLI's ``--data`` string (see :func:`parse_data_arg`).

    Returns a description of the source (stored in the report) and the records.
    """
    spec = parse_data_arg(data, hub_split)
    if spec["data"] == "synthetic":
        return "synthetic", load_eval_records("synthetic", limit=limit)
    if spec["data"] == "hub":
        return f"hub:{spec['hub_split']}", load_eval_records("hub", hub_split=spec["hub_split"], limit=limit)
    return f"local:{data}", load_eval_records("local", path=data, limit=limit)
