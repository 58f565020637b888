"""Loading GSM8K-format records (hub, local JSONL, synthetic) into one validated record schema.

Every later stage (prompt building, rewards, evaluation, lineage) relies on each record having a
clean, already-normalized final answer, so validation happens once, here, at load time: a record
whose solution has no ``#### <number>`` line is reported with its file and line number instead of
turning into a silent zero reward hours later.

A record is a plain dict::

    {"id": "train-00042", "question": "...", "solution": "...worked solution...\\n#### 72",
     "answer": "72", "steps": 2, "source": "train.jsonl"}

``answer`` is the canonical number string of :func:`posttrain.rewards.parsing.normalize_number`,
the same function the rewards and the evaluator apply to model output, so the two sides compare
equal exactly when the numbers are equal. ``steps`` counts the ``<<a*b=c>>`` calculator
annotations: a cheap, consistent difficulty proxy used for curriculum stages.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # config imports posttrain.data.prompts, so importing config here at runtime would cycle
    from posttrain.config import DataConfig

logger = logging.getLogger(__name__)

__all__ = [
    "RECORD_FIELDS",
    "DataError",
    "LoadResult",
    "count_steps",
    "extract_final_answer",
    "load_hub",
    "load_jsonl",
    "load_records",
    "make_record",
]

RECORD_FIELDS = ("id", "question", "solution", "answer", "steps", "source")
_ANNOTATION_RE = re.compile(r"<<[^<>]*>>")

OnBad = Literal["error", "skip"]


class DataError(ValueError):
    """Data that cannot be used; the message names where (file:line, hub split) and what is wrong."""


@dataclass(frozen=True)
class LoadResult:
    """Records that passed validation plus the ones skipped (``(file, line_no, reason)``).

    Skips are returned rather than only logged so the pipeline can put their count in its stats and
    a run that silently lost half its data is visible in the tracking UI.
    """

    records: list[dict[str, Any]]
    skipped: list[tuple[str, int, str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.records)


def _normalize_number(text: str) -> str | None:
    # Imported lazily: `posttrain.data` must stay importable from `posttrain.config` without pulling in
    # other packages whose imports might lead back to the config.
    from posttrain.rewards.parsing import normalize_number

    return normalize_number(text)


def extract_final_answer(solution: str) -> str:
    """Normalized number after the last ``####`` of a GSM8K worked solution.

    >>> extract_final_answer("48/2 = <<48/2=24>>24\\n#### 1,234")
    '1234'
    >>> extract_final_answer("#### $5"), extract_final_answer("#### -3"), extract_final_answer("#### 2.50")
    ('5', '-3', '2.5')
    >>> extract_final_answer("no final line")
    Traceback (most recent call last):
    ...
    posttrain.data.gsm8k.DataError: answer has no '#### <number>' final line
    """
    if not isinstance(solution, str) or "####" not in solution:
        raise DataError("answer has no '#### <number>' final line")
    raw = solution.rsplit("####", 1)[1].strip()
    value = _normalize_number(raw) if raw else None
    if value is None:
        raise DataError(f"final answer {raw!r} after '####' is not a number")
    return value


def count_steps(solution: str) -> int:
    """Number of ``<<...>>`` calculator annotations, GSM8K's own count of arithmetic steps.

    >>> count_steps("48/2 = <<48/2=24>>24\\n48+24 = <<48+24=72>>72\\n#### 72")
    2
    """
    return len(_ANNOTATION_RE.findall(solution))


def make_record(raw: Any, *, record_id: str, source: str) -> dict[str, Any]:
    """Validate one raw GSM8K row (``{"question", "answer"}``) into the record schema.

    Raises :class:`DataError` with the bare problem; callers prefix the location.
    """
    if not isinstance(raw, dict):
        raise DataError(f"expected a JSON object, got {type(raw).__name__}")
    for key in ("question", "answer"):
        if key not in raw:
            raise DataError(f"missing field '{key}'")
        if not isinstance(raw[key], str):
            raise DataError(f"field '{key}' must be a string, got {type(raw[key]).__name__}")
    question, solution = raw["question"].strip(), raw["answer"]
    if not question:
        raise DataError("field 'question' is empty")
    answer = extract_final_answer(solution)
    return {
        "id": record_id,
        "question": question,
        "solution": solution.strip(),
        "answer": answer,
        "steps": count_steps(solution),
        "source": source,
    }


def _jsonl_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.glob("*.jsonl") if p.is_file())
        if not files:
            raise DataError(f"{path}: folder contains no *.jsonl files")
        return files
    if path.is_file():
        return [path]
    raise DataError(f"{path}: no such file or folder (data.path must be a .jsonl file or a folder of them)")


def _iter_jsonl(file: Path) -> Iterator[tuple[int, Any | DataError]]:
    """(line number, parsed object or the parse error) for each non-blank line."""
    try:
        handle = file.open(encoding="utf-8")
    except OSError as exc:
        raise DataError(f"{file}: cannot read: {exc.strerror}") from None
    with handle:
        try:
            for line_no, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    yield line_no, json.loads(line)
                except json.JSONDecodeError as exc:
                    yield line_no, DataError(f"malformed JSON ({exc.msg} at column {exc.colno})")
        except UnicodeDecodeError as exc:
            raise DataError(f"{file}: not UTF-8 text ({exc.reason})") from None


class _Collector:
    """Turns raw rows into records, raising or counting bad ones according to ``on_bad_record``."""

    def __init__(self, on_bad_record: OnBad, limit: int | None) -> None:
        if on_bad_record not in ("error", "skip"):
            raise ValueError(f"on_bad_record must be 'error' or 'skip', got {on_bad_record!r}")
        self.on_bad_record, self.limit = on_bad_record, limit
        self.records: list[dict[str, Any]] = []
        self.skipped: list[tuple[str, int, str]] = []

    @property
    def full(self) -> bool:
        return self.limit is not None and len(self.records) >= self.limit

    def add(self, raw: Any, *, where: str, line_no: int, record_id: str, source: str) -> None:
        try:
            if isinstance(raw, DataError):
                raise raw
            self.records.append(make_record(raw, record_id=record_id, source=source))
        except DataError as exc:
            if self.on_bad_record == "error":
                raise DataError(f"{where}:{line_no}: {exc}") from None
            self.skipped.append((where, line_no, str(exc)))

    def result(self, what: str) -> LoadResult:
        if self.skipped:
            first = self.skipped[0]
            logger.warning(
                "skipped %d bad record(s) in %s (on_bad_record=skip); first: %s:%d: %s",
                len(self.skipped),
                what,
                *first,
            )
        return LoadResult(self.records, self.skipped)


def load_jsonl(path: str | Path, on_bad_record: OnBad = "error", limit: int | None = None) -> LoadResult:
    """Records of a GSM8K-format ``.jsonl`` file, or of every ``*.jsonl`` in a folder (sorted by name).

    Ids are ``<file stem>-<line number, 5 digits>``, stable as long as the file is. ``source`` is the
    file name (not the full path, so the same data prepared on two machines fingerprints the same).
    ``limit`` stops after that many *valid* records.
    """
    path = Path(path)
    collector = _Collector(on_bad_record, limit)
    for file in _jsonl_files(path):
        for line_no, raw in _iter_jsonl(file):
            if collector.full:
                break
            collector.add(
                raw,
                where=str(file),
                line_no=line_no,
                record_id=f"{file.stem}-{line_no:05d}",
                source=file.name,
            )
        if collector.full:
            break
    return collector.result(str(path))


def load_hub(
    hub_id: str = "openai/gsm8k",
    config: str | None = "main",
    split: str = "train",
    *,
    on_bad_record: OnBad = "error",
    limit: int | None = None,
) -> LoadResult:
    """Records of a GSM8K-format split on the Hugging Face Hub (or the local datasets cache).

    Ids are ``<dataset name>-<split>-<row index, 5 digits>`` (``gsm8k-train-00042``); errors name the
    0-based row (``openai/gsm8k[train]:42: ...``). ``limit`` counts valid records, as in
    :func:`load_jsonl`. Any failure to fetch is re-raised as a :class:`DataError` pointing at the
    offline alternatives: the usual cause is a machine without network, where the raw traceback is
    long and unhelpful.
    """
    import datasets

    try:
        ds = datasets.load_dataset(hub_id, config, split=split)
    except Exception as exc:  # connection errors, offline mode, missing repo/split: all fail the same way
        raise DataError(
            f"cannot load {hub_id!r} (config {config!r}, split {split!r}) from the Hugging Face Hub: "
            f"{type(exc).__name__}: {exc}. The hub may be unreachable from this machine; set "
            "`data.source: local` with `data.path` pointing at a GSM8K .jsonl, or `data.source: synthetic`."
        ) from exc
    name = hub_id.rstrip("/").split("/")[-1]
    where = f"{hub_id}[{split}]"
    collector = _Collector(on_bad_record, limit)
    for index, row in enumerate(ds):
        if collector.full:
            break
        collector.add(row, where=where, line_no=index, record_id=f"{name}-{split}-{index:05d}", source=hub_id)
    return collector.result(where)


def load_records(cfg: DataConfig) -> LoadResult:
    """Dispatch on ``cfg.source`` and apply ``cfg.limit`` (first N valid records, in file order)."""
    if cfg.source == "local":
        if not cfg.path:
            raise DataError("data.source is 'local' but data.path is not set")
        return load_jsonl(cfg.path, cfg.on_bad_record, limit=cfg.limit)
    if cfg.source == "hub":
        return load_hub(
            cfg.hub_id, cfg.hub_config, cfg.split, on_bad_record=cfg.on_bad_record, limit=cfg.limit
        )
    if cfg.source == "synthetic":
        from posttrain.data.synthetic import generate_problems

        syn = cfg.synthetic
        count = syn.num_examples if cfg.limit is None else min(syn.num_examples, cfg.limit)
        return LoadResult(generate_problems(count, syn.min_steps, syn.max_steps, syn.seed))
    raise DataError(f"unknown data.source {cfg.source!r} (expected hub, local or synthetic)")
