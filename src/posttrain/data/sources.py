"""Reading GSM8K-format records from their sources: the hub, local JSONL files, the synthetic generator;
and saving a hub split as a local JSONL file, so a machine without network can train on real data.

Each raw row goes through :func:`posttrain.core.gsm8k.make_record`; a bad row stops the load with
``file:line: problem`` or, with ``on_bad_record: skip``, is counted and reported, so a run that
silently lost half its data is visible.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from posttrain.core.config import DataConfig
from posttrain.core.errors import DataError
from posttrain.core.gsm8k import make_record
from posttrain.data.synthetic import generate_problems

logger = logging.getLogger(__name__)

__all__ = ["LoadResult", "hold_out_last", "load_hub", "load_jsonl", "load_records", "save_hub_split"]

OnBad = Literal["error", "skip"]


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
                except RecursionError:  # a GSM8K record is two strings; thousands of [ are not one
                    yield line_no, DataError("nested too deeply to be a GSM8K record")
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
    name = hub_id.rstrip("/").split("/")[-1]
    where = f"{hub_id}[{split}]"
    collector = _Collector(on_bad_record, limit)
    for index, row in enumerate(_hub_rows(hub_id, config, split)):
        if collector.full:
            break
        collector.add(row, where=where, line_no=index, record_id=f"{name}-{split}-{index:05d}", source=hub_id)
    return collector.result(where)


def save_hub_split(
    output: str | Path, hub_id: str = "openai/gsm8k", config: str | None = "main", split: str = "train"
) -> int:
    """Save a GSM8K-format hub split as a JSONL file in the official format (``question``,
    ``answer``), for ``data.source: local`` on machines that cannot reach the hub. Returns the rows
    written.

    Every row is checked as a run would read it (a bad row stops with ``openai/gsm8k[train]:42:
    problem``), and the file is written beside its name and renamed into place, so a config that
    names it never reads half a download.
    """
    output = Path(output)
    where = f"{hub_id}[{split}]"
    lines = []
    for index, row in enumerate(_hub_rows(hub_id, config, split)):
        try:
            make_record(row, record_id=str(index), source=hub_id)
        except DataError as exc:
            raise DataError(f"{where}:{index}: {exc}") from None
        lines.append(json.dumps({"question": row["question"], "answer": row["answer"]}, ensure_ascii=False))
    if not lines:
        raise DataError(f"{where}: the split has no rows")
    _write_lines(output, lines)
    return len(lines)


def hold_out_last(source: str | Path, last: int, train: str | Path, test: str | Path) -> tuple[int, int]:
    """Write the last ``last`` records of the GSM8K file ``source`` to ``test`` and the others to
    ``train``, each line as it was; returns (train lines, test lines).

    A stand-in for a test split where the real one cannot be fetched: a run that trains on ``train``
    never sees a ``test`` question. Every line is checked as a run would read it first (``file:line:
    problem``), and each file is written beside its name and renamed into place.
    """
    if last < 1:
        raise DataError(f"--last must be >= 1, got {last}")
    source = Path(source)
    if not source.is_file():
        raise DataError(f"{source}: not a file (give one GSM8K .jsonl file)")
    if source.resolve() in (Path(train).resolve(), Path(test).resolve()):
        raise DataError(f"{source}: write the two parts to other files (a second run would hold out more)")
    if Path(train).resolve() == Path(test).resolve():
        raise DataError(
            f"{test}: --train and --test name one file (the held-out part would replace the rest)"
        )
    load_jsonl(source)  # every line parses: a bad one stops here, before anything is written
    lines = [line for line in source.read_text(encoding="utf-8").splitlines() if line.strip()]
    if last >= len(lines):
        raise DataError(f"{source}: {len(lines)} records; --last {last} would leave none to train on")
    kept, held = lines[:-last], lines[-last:]
    _write_lines(Path(train), kept)
    _write_lines(Path(test), held)
    return len(kept), len(held)


def _write_lines(output: Path, lines: list[str]) -> None:
    """``lines`` as ``output``, written beside it and renamed into place: a reader never sees half."""
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-{secrets.token_hex(4)}")
    try:
        tmp.write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")
        os.replace(tmp, output)
    finally:
        tmp.unlink(missing_ok=True)


def _hub_rows(hub_id: str, config: str | None, split: str) -> Any:
    """The split as ``datasets`` loads it (or finds it in its cache). Any failure to fetch becomes a
    :class:`DataError` pointing at the offline alternatives: the usual cause is a machine without
    network, where the raw traceback is long and unhelpful."""
    import datasets  # heavy: deferred until needed

    try:
        return datasets.load_dataset(hub_id, config, split=split)
    except Exception as exc:  # connection errors, offline mode, missing repo/split: all fail the same way
        raise DataError(
            f"cannot load {hub_id!r} (config {config!r}, split {split!r}) from the Hugging Face Hub: "
            f"{type(exc).__name__}: {exc}. The hub may be unreachable from this machine; save the split "
            "where it is reachable (`posttrain data fetch gsm8k --split train --output FILE`) and set "
            "`data.source: local` with `data.path: FILE`, or use `data.source: synthetic`."
        ) from exc


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
        syn = cfg.synthetic
        count = syn.num_examples if cfg.limit is None else min(syn.num_examples, cfg.limit)
        return LoadResult(
            generate_problems(count, syn.min_ops, syn.max_ops, cfg.seed, syn.numbers, syn.themes)
        )
    raise DataError(f"unknown data.source {cfg.source!r} (expected hub, local or synthetic)")
