"""From a :class:`~posttrain.core.config.DataConfig` to the train/eval datasets every stage consumes.

One function owns the order of operations (load, split, decontaminate, build prompts, drop
over-long prompts) so every stage sees the same examples, and every removal is counted in
``stats``: a run that silently trained on 40% of its data, or on questions overlapping its
evaluation set, is the failure this module exists to make visible.

With ``selection_size``, a *selection slice* is cut from the training records after the held-out
split: records a stage evaluates itself on while it trains, to keep its best checkpoint
(``keep: best``, :mod:`posttrain.core.keep_best`). It is never trained on, decontaminated against
every evaluation question like the training records, and checked disjoint from the held-out and
training records by id (:func:`check_disjoint`): choosing a checkpoint on the questions the final
evaluation asks would overstate the gain.

A GRPO stage with a ``data:`` source of its own gets a split of its own (``stage_train``), prepared
from that source with the run's prompt and filters: nothing is held out of it, and every question
that overlaps an evaluation question, the held-out slice or the selection slice is removed. With
its own ``selection_size`` it also gets a selection slice of its own (``stage_selection``), cut from
that source the same way and never trained on by any stage: the stage evaluates itself on the
questions it learns to answer, not on the run's.

The datasets' ``_fingerprint`` values are content hashes (in-memory datasets are fingerprinted from
their Arrow data), so equal preparation gives equal fingerprints on any machine; they are recorded
in ``stats`` as the lineage of everything trained on them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from posttrain.core.config import DataConfig
from posttrain.core.errors import DataError
from posttrain.core.gsm8k import RECORD_FIELDS
from posttrain.core.prompts import build_prompt, select_few_shot
from posttrain.data.sources import load_records

logger = logging.getLogger(__name__)

__all__ = [
    "FEATURES",
    "MESSAGES_FEATURE",
    "PreparedData",
    "check_disjoint",
    "decontaminate",
    "filter_by_ops",
    "records_in_ops_range",
    "prepare_data",
    "prompt_token_lengths",
    "select_stage_data",
    "question_ngrams",
    "split_records",
    "split_selection",
]

MESSAGES_FEATURE = datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")})
FEATURES = datasets.Features(
    {
        "id": datasets.Value("string"),
        "question": datasets.Value("string"),
        "solution": datasets.Value("string"),
        "answer": datasets.Value("string"),
        "ops": datasets.Value("int32"),
        "source": datasets.Value("string"),
        "prompt": MESSAGES_FEATURE,
    }
)
_PUNCTUATION_RE = re.compile(r"[^\w\s]")


@dataclass(frozen=True)
class PreparedData:
    """Training, held-out and (optional) selection datasets (columns of :data:`FEATURES`) plus the
    counts of each step."""

    train: datasets.Dataset
    eval: datasets.Dataset
    stats: dict[str, Any]
    selection: datasets.Dataset | None = None
    """Records set aside to choose checkpoints on (``data.selection_size``); None without."""
    stage_train: Mapping[str, datasets.Dataset] = dataclasses.field(default_factory=dict)
    """The prompts of each GRPO stage that has a ``data:`` source of its own, by step name."""
    stage_selection: Mapping[str, datasets.Dataset] = dataclasses.field(default_factory=dict)
    """The selection slice cut from such a stage's source (its ``selection_size``), by step name."""

    def train_for(self, stage: str) -> datasets.Dataset:
        """What training stage ``stage`` (a step name) draws from: its own split, else ``train``."""
        return self.stage_train.get(stage, self.train)

    def selection_for(self, stage: str | None) -> datasets.Dataset:
        """What training stage ``stage`` (a step name) chooses its checkpoint by: its own selection
        slice, else the run's (never the set the final evaluation reports), else the held-out split."""
        if stage is not None and stage in self.stage_selection:
            return self.stage_selection[stage]
        return self.selection if self.selection is not None else self.eval

    def save(self, directory: str | Path) -> Path:
        """Write ``train/``, ``eval/``, ``selection/`` (``save_to_disk``) and ``stats.json`` under ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.train.save_to_disk(str(directory / "train"))
        self.eval.save_to_disk(str(directory / "eval"))
        if self.selection is not None:
            self.selection.save_to_disk(str(directory / "selection"))
        for stage, dataset in self.stage_train.items():
            dataset.save_to_disk(str(directory / STAGE_FOLDER / stage))
        for stage, dataset in self.stage_selection.items():
            dataset.save_to_disk(str(directory / STAGE_SELECTION_FOLDER / stage))
        (directory / "stats.json").write_text(json.dumps(self.stats, indent=2, sort_keys=True) + "\n")
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> PreparedData:
        """Read what :meth:`save` wrote, with the fingerprints recorded at preparation time.

        ``load_from_disk`` re-derives a fingerprint (it re-applies the format), so the recorded one
        is restored: the lineage id of a loaded dataset is the one logged when it was prepared.
        """
        directory = Path(directory)
        stats_file = directory / "stats.json"
        if not stats_file.is_file():
            raise DataError(f"{directory}: not a prepared-data folder (no stats.json)")
        stats = json.loads(stats_file.read_text())
        parts = {}
        for name in ("train", "eval", "selection"):
            if name == "selection" and not (directory / name).is_dir():
                continue
            parts[name] = _load_split(directory / name, stats.get(f"{name}_fingerprint"))
        # The stage names come from stats.json, which is store content: only a stage step's name
        # (no separator, no dots) may become a path under the folder.
        stage_train = {
            stage: _load_split(directory / STAGE_FOLDER / stage, stats[f"{stage}.train_fingerprint"])
            for stage in stage_sources_in(stats)
        }
        stage_selection = {
            stage: _load_split(
                directory / STAGE_SELECTION_FOLDER / stage, stats[f"{stage}.selection_fingerprint"]
            )
            for stage in stage_train
            if stats.get(f"{stage}.selection_fingerprint")
        }
        return cls(
            train=parts["train"],
            eval=parts["eval"],
            stats=stats,
            selection=parts.get("selection"),
            stage_train=stage_train,
            stage_selection=stage_selection,
        )


STAGE_FOLDER = "stages"
"""Where :meth:`PreparedData.save` puts each stage's own split: ``stages/<step name>/``."""
STAGE_SELECTION_FOLDER = "stage-selections"
"""And each stage's own selection slice: ``stage-selections/<step name>/``."""
_STAGE_NAME_RE = re.compile(r"^(grpo|rft)-[a-z0-9][a-z0-9_-]*$")


def stage_sources_in(stats: Mapping[str, Any]) -> list[str]:
    """The step names of the stages with a split of their own, as a data step's ``stats`` records
    them (``<step>.train_fingerprint``); a name that is not a ``grpo:`` stage's is not one of them.

    >>> stage_sources_in({"train_fingerprint": "a", "grpo-new.train_fingerprint": "b", "../x.train_fingerprint": "c"})
    ['grpo-new']
    """
    names = (key.removesuffix(".train_fingerprint") for key in stats if key.endswith(".train_fingerprint"))
    return sorted(name for name in names if _STAGE_NAME_RE.match(name))


def _load_split(folder: Path, fingerprint: Any) -> datasets.Dataset:
    ds = datasets.load_from_disk(str(folder))
    if fingerprint:
        ds._fingerprint = fingerprint
    return ds


def split_records(
    records: Sequence[dict[str, Any]], eval_size: int, seed: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, eval): the ``eval_size`` records whose ``sha256(seed:id)`` is smallest are held out.

    Ranking by a hash of the id (not by shuffling positions) makes a record's membership depend only
    on its id and the seed, in any process; both parts keep the input order.

    >>> recs = [{"id": str(i)} for i in range(10)]
    >>> train, held = split_records(recs, 3, seed=0)
    >>> len(train), len(held), {r["id"] for r in train} & {r["id"] for r in held}
    (7, 3, set())
    """
    return _hash_split(records, eval_size, f"{seed}:", "data.eval_size", "held-out slice")


def split_selection(
    records: Sequence[dict[str, Any]], selection_size: int, seed: int, key: str = "data.selection_size"
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train, selection): :func:`split_records` with its own salt, so the selection slice is a
    random draw of the training records, independent of which records were held out. ``key`` is
    the setting an error names.

    >>> recs = [{"id": str(i)} for i in range(10)]
    >>> train, selection = split_selection(recs, 2, seed=0)
    >>> len(train), len(selection), split_selection(recs, 0, seed=0) == (recs, [])
    (8, 2, True)
    """
    if selection_size == 0:
        return list(records), []
    return _hash_split(records, selection_size, f"{seed}:selection:", key, "selection slice")


def _hash_split(
    records: Sequence[dict[str, Any]], size: int, salt: str, key: str, what: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    if size < 0:
        raise DataError(f"{key} must be >= 0, got {size}")
    if size >= len(records):
        raise DataError(
            f"{key}={size} but only {len(records)} records are left for it; the {what} must leave at least "
            f"one training record (lower {key.split('.')[-1]} or load more data)"
        )

    def rank(index: int) -> tuple[str, int]:
        return hashlib.sha256(f"{salt}{records[index]['id']}".encode()).hexdigest(), index

    held = set(sorted(range(len(records)), key=rank)[:size])
    train = [r for i, r in enumerate(records) if i not in held]
    return train, [r for i, r in enumerate(records) if i in held]


def check_disjoint(selection: Sequence[dict[str, Any]], **others: Sequence[dict[str, Any]]) -> None:
    """Raise :class:`DataError` if a selection record's id is among ``others``' (named) records.

    >>> check_disjoint([{"id": "a"}], heldout=[{"id": "b"}], train=[{"id": "c"}])
    >>> check_disjoint([{"id": "a"}], heldout=[{"id": "a"}])
    Traceback (most recent call last):
    ...
    posttrain.core.errors.DataError: the selection slice shares 1 id(s) with the heldout records (first: a)
    """
    ids = {r["id"] for r in selection}
    for name, records in others.items():
        shared = sorted(ids & {r["id"] for r in records})
        if shared:
            raise DataError(
                f"the selection slice shares {len(shared)} id(s) with the {name} records (first: {shared[0]})"
            )


def question_ngrams(text: str, n: int | None) -> set[tuple[str, ...]]:
    """Word ``n``-grams of a question after lowercasing and stripping punctuation.

    A question shorter than ``n`` words (or any question when ``n`` is None) yields its whole word
    tuple, so exact duplicates are always caught.

    >>> sorted(question_ngrams("Tom has 3 apples. He eats one!", 6))
    [('has', '3', 'apples', 'he', 'eats', 'one'), ('tom', 'has', '3', 'apples', 'he', 'eats')]
    """
    words = _PUNCTUATION_RE.sub("", text.lower()).split()
    if n is None or len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def _overlap_rule(cfg: DataConfig) -> tuple[str, int | None]:
    """(name, n) of the decontamination ``cfg``'s records get: ``off``, ``exact`` (n None) or ``N-gram``.

    Generated problems share template sentences by design (an 8-gram check would drop most of
    them), and cannot copy GSM8K; for them only an exact duplicate question is contamination.

    >>> _overlap_rule(DataConfig(source="synthetic")), _overlap_rule(DataConfig(source="hub"))
    (('exact', None), ('8-gram', 8))
    """
    if cfg.decontamination_ngram is None:
        return "off", None
    n = None if cfg.source == "synthetic" else cfg.decontamination_ngram
    return ("exact" if n is None else f"{n}-gram"), n


def decontaminate(
    records: Sequence[dict[str, Any]], eval_questions: Iterable[str], n: int | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(kept, removed): a record is removed when its question shares a word n-gram with an eval question.

    An 8-gram overlap catches copies and light paraphrases (renamed people, changed numbers keep
    most 8-word runs) while two distinct GSM8K questions rarely share one. ``n=None`` removes
    exact (normalized) duplicates only.
    """
    if n is not None and n < 1:
        raise DataError(f"data.decontamination_ngram must be >= 1, got {n}")
    banned: set[tuple[str, ...]] = set()
    for question in eval_questions:
        banned |= question_ngrams(question, n)
    kept, removed = [], []
    for record in records:
        hit = not banned.isdisjoint(question_ngrams(record["question"], n))
        (removed if hit else kept).append(record)
    return kept, removed


def _shared_prefix_cut(tokenizer: Any, texts: Sequence[str]) -> int:
    """End of the last added/special token inside the prefix all ``texts`` share (0 if none).

    Fast tokenizers split the input at added tokens before anything else, so for most chat
    templates the text after such a token tokenizes the same on its own; the caller verifies this.
    """
    prefix = os.path.commonprefix(list(texts))
    markers = [str(t) for t in getattr(tokenizer, "added_tokens_decoder", {}).values()]
    ends = [prefix.rfind(m) + len(m) for m in markers if m and prefix.rfind(m) >= 0]
    return max(ends, default=0)


def prompt_token_lengths(
    tokenizer: Any, prompts: Sequence[list[dict[str, str]]], batch_size: int = 1024
) -> list[int]:
    """Token count of each prompt as the model sees it: ``apply_chat_template(add_generation_prompt=True)``.

    Fast because the system prompt and few-shot turns are usually most of every prompt: the shared
    rendered prefix up to its last special token is tokenized once and only the rest per prompt
    (in batches, in Rust). The shortcut is used only if it reproduces ``apply_chat_template``'s
    exact counts on a spread of prompts; otherwise whole prompts are tokenized.
    """
    if not prompts:
        return []
    try:
        texts = tokenizer.apply_chat_template(
            [list(p) for p in prompts], add_generation_prompt=True, tokenize=False
        )
    except ValueError as exc:
        raise DataError(f"cannot apply the tokenizer's chat template to the prompts: {exc}") from exc

    def count(parts: Sequence[str]) -> list[int]:
        out: list[int] = []
        for start in range(0, len(parts), batch_size):
            encoded = tokenizer(list(parts[start : start + batch_size]), add_special_tokens=False)
            out.extend(len(ids) for ids in encoded["input_ids"])
        return out

    cut = _shared_prefix_cut(tokenizer, texts)
    if cut:
        head = count([texts[0][:cut]])[0]
        sample = sorted({*range(0, len(texts), max(1, len(texts) // 16)), len(texts) - 1})
        exact = [
            len(
                tokenizer.apply_chat_template(list(prompts[i]), add_generation_prompt=True, return_dict=False)
            )
            for i in sample
        ]
        if exact == [head + n for n in count([texts[i][cut:] for i in sample])]:
            return [head + n for n in count([text[cut:] for text in texts])]
        logger.debug("shared-prefix token count does not match this tokenizer; tokenizing whole prompts")
    return count(texts)


def _to_dataset(records: Sequence[dict[str, Any]]) -> datasets.Dataset:
    columns = {name: [r[name] for r in records] for name in (*RECORD_FIELDS, "prompt")}
    return datasets.Dataset.from_dict(columns, features=FEATURES)


def _describe_source(cfg: DataConfig) -> str:
    if cfg.source == "local":
        return f"local data {cfg.path}"
    if cfg.source == "hub":
        return f"hub dataset {cfg.hub_id}[{cfg.split}]"
    return f"synthetic data (num_examples={cfg.synthetic.num_examples})"


def prepare_data(
    cfg: DataConfig,
    tokenizer: Any = None,
    eval_questions: Sequence[str] = (),
    stage_sources: Mapping[str, DataConfig] | None = None,
) -> PreparedData:
    """Load, split, decontaminate, add the ``prompt`` column and drop prompts over ``max_prompt_tokens``.

    ``eval_questions`` are extra questions that training must not overlap (e.g. the GSM8K test
    split the final evaluation uses), on top of the held-out slice. Without a ``tokenizer`` the
    prompt-length filter is skipped. ``stage_sources`` (step name -> the data settings of a GRPO
    stage's own source, :meth:`DataConfig.source_of`) become the ``stage_train`` splits, and
    ``stage_selection`` slices where they set ``selection_size``. Raises
    :class:`DataError` when nothing is left to train on, naming the step that removed the last
    records.
    """
    loaded = load_records(cfg)
    source = _describe_source(cfg)
    if not loaded.records:
        raise DataError(f"no usable records in {source} ({len(loaded.skipped)} skipped as bad)")
    train, held = split_records(loaded.records, cfg.eval_size, cfg.seed)
    train, selection = split_selection(train, cfg.selection_size, cfg.seed)
    after_split = len(train)

    removed: list[dict[str, Any]] = []
    selection_removed: list[dict[str, Any]] = []
    mode, n = _overlap_rule(cfg)
    if mode != "off":
        eval_qs = [r["question"] for r in held] + list(eval_questions)
        # The selection slice must not overlap what is reported, nor what is trained on.
        selection, selection_removed = decontaminate(selection, eval_qs, n)
        train, removed = decontaminate(train, eval_qs + [r["question"] for r in selection], n)
        if removed:
            logger.info(
                "decontamination (%s) removed %d training question(s) overlapping %d eval question(s); first: %s",
                mode,
                len(removed),
                len(eval_qs),
                removed[0]["id"],
            )

    if cfg.selection_size and not selection:
        raise DataError(
            f"data.selection_size={cfg.selection_size}: decontamination ({mode}) removed every selection record"
        )
    check_disjoint(selection, heldout=held, train=train)
    few_shot = select_few_shot(cfg.few_shot)
    for record in (*train, *held, *selection):
        record["prompt"] = build_prompt(record["question"], cfg.system_prompt, few_shot)
    # What a stage's own prompts must not overlap: every question the run reports or selects on.
    reported = [r["question"] for r in (*held, *selection)] + list(eval_questions)
    stage_train: dict[str, datasets.Dataset] = {}
    stage_stats: dict[str, Any] = {}
    stage_selection: dict[str, datasets.Dataset] = {}
    trained = [r["question"] for r in train]
    sources = dict(stage_sources or {})
    cuts = {stage: _cut_stage_selection(stage, c, reported, trained) for stage, c in sources.items()}
    # No stage trains on a question any stage chooses its checkpoint by.
    avoid = [*reported, *(r["question"] for cut in cuts.values() for r in cut.selection)]
    for stage, stage_cfg in sources.items():
        own, counts = _prepare_stage_source(stage, stage_cfg, cuts[stage], tokenizer, avoid, few_shot)
        stage_train[stage] = own.train
        if own.selection is not None:
            stage_selection[stage] = own.selection
        stage_stats.update({f"{stage}.{k}": v for k, v in counts.items()})

    too_long, eval_too_long, longest = 0, 0, None
    if tokenizer is not None and train:
        lengths = prompt_token_lengths(tokenizer, [r["prompt"] for r in (*train, *held)])
        train_lengths, eval_lengths = lengths[: len(train)], lengths[len(train) :]
        longest = max(lengths)
        kept = [r for r, n in zip(train, train_lengths, strict=True) if n <= cfg.max_prompt_tokens]
        too_long, train = len(train) - len(kept), kept
        # The held-out slice is not filtered: shrinking it toward short problems would bias the metric.
        eval_too_long = sum(n > cfg.max_prompt_tokens for n in eval_lengths)
        if too_long or eval_too_long:
            logger.warning(
                "%d training prompt(s) longer than data.max_prompt_tokens=%d dropped (longest: %d tokens); "
                "%d held-out prompt(s) are over the limit too (kept)",
                too_long,
                cfg.max_prompt_tokens,
                longest,
                eval_too_long,
            )

    if not train:
        if after_split and len(removed) == after_split:
            why = f"decontamination ({mode} overlap with eval questions) removed all {after_split}"
        else:
            why = (
                f"all {after_split - len(removed)} remaining prompts are longer than "
                f"data.max_prompt_tokens={cfg.max_prompt_tokens} (longest: {longest} tokens)"
            )
        raise DataError(
            f"no training records left from {source}: loaded {len(loaded.records)}, held out {len(held)} for eval, "
            f"then {why}"
        )

    train_ds, eval_ds = _to_dataset(train), _to_dataset(held)
    selection_ds = _to_dataset(selection) if selection else None
    selection_stats = (
        {
            "selection": len(selection),
            "selection_decontaminated": len(selection_removed),
            "selection_fingerprint": selection_ds._fingerprint,
        }
        if selection_ds is not None
        else {}
    )
    stats: dict[str, Any] = {
        "loaded": len(loaded.records),
        "skipped_bad": len(loaded.skipped),
        "eval": len(eval_ds),
        "decontaminated": len(removed),
        "decontamination": mode,
        "dropped_long_prompts": too_long,
        "eval_long_prompts": eval_too_long,
        "train": len(train_ds),
        "train_ops": {str(k): v for k, v in sorted(Counter(r["ops"] for r in train).items())},
        "train_fingerprint": train_ds._fingerprint,
        "eval_fingerprint": eval_ds._fingerprint,
        **selection_stats,
        **stage_stats,
    }
    logger.info(
        "prepared %s: %s", source, {k: v for k, v in stats.items() if k != "train_ops" and "." not in k}
    )
    return PreparedData(
        train=train_ds,
        eval=eval_ds,
        stats=stats,
        selection=selection_ds,
        stage_train=stage_train,
        stage_selection=stage_selection,
    )


@dataclasses.dataclass(frozen=True)
class _StageSplit:
    train: datasets.Dataset
    selection: datasets.Dataset | None


@dataclasses.dataclass(frozen=True)
class _StageCut:
    """A stage source's records, read and split: its prompts-to-be and its selection slice."""

    loaded: Any
    records: list[dict[str, Any]]
    selection: list[dict[str, Any]]
    selection_removed: list[dict[str, Any]]


def _cut_stage_selection(
    stage: str, cfg: DataConfig, reported: Sequence[str], trained: Sequence[str]
) -> _StageCut:
    """Read a stage's source and cut its selection slice (``cfg.selection_size``; none at 0) without
    the questions that overlap ``reported`` or ``trained`` (the run's training questions)."""
    loaded = load_records(cfg)
    key = f"{stage}'s data.selection_size"  # the step name: this module does not know the stage's index
    records, selection = split_selection(list(loaded.records), cfg.selection_size, cfg.seed, key)
    mode, n = _overlap_rule(cfg)
    selection_removed: list[dict[str, Any]] = []
    if mode != "off":
        selection, selection_removed = decontaminate(selection, [*reported, *trained], n)
    if cfg.selection_size and not selection:
        raise DataError(
            f"{key}={cfg.selection_size}: decontamination ({mode}) removed every selection record"
        )
    return _StageCut(loaded, records, selection, selection_removed)


def _prepare_stage_source(
    stage: str,
    cfg: DataConfig,
    cut: _StageCut,
    tokenizer: Any,
    avoid: Sequence[str],
    few_shot: Sequence[Any],
) -> tuple[_StageSplit, dict[str, Any]]:
    """A GRPO stage's own prompts: the records of its source ``cut`` left outside its selection
    slice, without those that overlap ``avoid`` (every question the run reports or selects on and
    every stage's selection slice), with prompts built and over-long ones dropped as for ``train``."""
    loaded, selection, selection_removed = cut.loaded, cut.selection, cut.selection_removed
    source = f"{_describe_source(cfg)} of {stage}"
    records, removed = cut.records, []
    mode, n = _overlap_rule(cfg)
    if mode != "off":
        records, removed = decontaminate(records, avoid, n)
    for record in (*records, *selection):
        record["prompt"] = build_prompt(record["question"], cfg.system_prompt, few_shot)
    too_long = 0
    if tokenizer is not None and records:
        lengths = prompt_token_lengths(tokenizer, [r["prompt"] for r in records])
        kept = [r for r, n in zip(records, lengths, strict=True) if n <= cfg.max_prompt_tokens]
        too_long, records = len(records) - len(kept), kept
        if too_long:
            logger.warning(
                "%s: %d prompt(s) longer than data.max_prompt_tokens=%d dropped",
                source,
                too_long,
                cfg.max_prompt_tokens,
            )
    if not records:
        raise DataError(
            f"no prompts left from {source}: loaded {len(loaded.records)} ({len(loaded.skipped)} skipped as bad), "
            f"{len(selection)} set aside as its selection slice, {len(removed)} removed by decontamination "
            f"({mode}), {too_long} over data.max_prompt_tokens"
        )
    dataset = _to_dataset(records)
    selection_ds = _to_dataset(selection) if selection else None
    counts = {
        "loaded": len(loaded.records),
        "skipped_bad": len(loaded.skipped),
        "decontaminated": len(removed),
        "dropped_long_prompts": too_long,
        "train": len(dataset),
        "train_fingerprint": dataset._fingerprint,
    }
    if selection_ds is not None:
        counts.update(
            selection=len(selection_ds),
            selection_decontaminated=len(selection_removed),
            selection_fingerprint=selection_ds._fingerprint,
        )
    logger.info(
        "prepared %s: %d prompts (%d removed by decontamination)%s",
        source,
        len(dataset),
        len(removed),
        f", {len(selection)} in its selection slice" if selection else "",
    )
    return _StageSplit(dataset, selection_ds), counts


def _ops_in_range(ops: list[int], lo: int | None, hi: int | None) -> list[bool]:
    return [(lo is None or n >= lo) and (hi is None or n <= hi) for n in ops]


def select_stage_data(dataset: datasets.Dataset, data_filter: Any) -> datasets.Dataset:
    """Apply a GRPO stage's ``data_filter``: operation range first, then the first ``limit`` rows."""
    ds = filter_by_ops(dataset, data_filter.min_ops, data_filter.max_ops)
    if data_filter.limit is not None and data_filter.limit < len(ds):
        ds = ds.select(range(data_filter.limit))
    return ds


def records_in_ops_range(ds: datasets.Dataset, data_filter: Any) -> datasets.Dataset:
    """The records a stage with ``data_filter`` evaluates itself on: those in its operation range,
    so reward and accuracy measure the same difficulty; all of them (with a warning) where none lie
    in it, since an evaluation slice of another difficulty still ranks checkpoints."""
    try:
        return filter_by_ops(ds, data_filter.min_ops, data_filter.max_ops)
    except DataError as exc:
        logger.warning("in-training evaluation: %s; evaluating the whole slice instead", exc)
        return ds


def filter_by_ops(
    ds: datasets.Dataset, min_ops: int | None = None, max_ops: int | None = None
) -> datasets.Dataset:
    """Rows whose ``ops`` (arithmetic operations) lie in ``[min_ops, max_ops]`` (either bound optional), for curriculum stages.

    An empty result raises :class:`DataError` listing the step counts that do exist, since a stage
    with no data would otherwise fail deep inside the trainer.
    """
    if min_ops is None and max_ops is None:
        return ds
    if min_ops is not None and max_ops is not None and min_ops > max_ops:
        raise DataError(f"min_ops ({min_ops}) > max_ops ({max_ops})")
    out = ds.filter(
        _ops_in_range,
        input_columns="ops",
        batched=True,
        fn_kwargs={"lo": min_ops, "hi": max_ops},
        desc="filter by ops",
    )
    if len(out) == 0:
        present = sorted(set(ds["ops"]))
        raise DataError(f"no examples with ops in [{min_ops}, {max_ops}]; the dataset has ops {present}")
    return out
