"""Stage-specific dataset shapes built from prepared records: SFT prompt-completion, DPO preference pairs.

Pure functions over data: generation and scoring happen in the training code, which hands the
completions and their scores here, so pair selection can be tested on hand-scored examples.

TRL 1.16 formats produced:

* SFT, conversational prompt-completion: ``prompt`` (messages) + ``completion``
  (``[{"role": "assistant", ...}]``); SFTTrainer then computes the loss on the completion only.
* DPO, conversational preference: ``prompt`` + ``chosen`` / ``rejected`` assistant messages.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import datasets

from posttrain.core.errors import DataError
from posttrain.core.parsing import completion_text
from posttrain.core.prompts import format_sft_target
from posttrain.data.prepare import MESSAGES_FEATURE

logger = logging.getLogger(__name__)

__all__ = [
    "DPO_FEATURES",
    "SFT_FEATURES",
    "DpoPair",
    "RFTData",
    "build_dpo_dataset",
    "build_rft_dataset",
    "build_sft_dataset",
    "select_dpo_pair",
]

DPO_FEATURES = datasets.Features(
    {"prompt": MESSAGES_FEATURE, "chosen": MESSAGES_FEATURE, "rejected": MESSAGES_FEATURE}
)
SFT_FEATURES = datasets.Features({"prompt": MESSAGES_FEATURE, "completion": MESSAGES_FEATURE})


def _assistant(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def build_sft_dataset(
    ds: datasets.Dataset, keep_columns: Sequence[str] = (), *, calculator: bool = False
) -> datasets.Dataset:
    """``prompt`` + ``completion`` (the worked solution in the trained XML format) for SFTTrainer.

    Other columns are dropped unless listed in ``keep_columns`` (e.g. ``("id",)``): SFTTrainer
    would otherwise try to tokenize or collate them. ``calculator`` writes each annotated step the
    way the inline calculator completes it (:func:`posttrain.core.prompts.format_sft_target`).
    """

    def completions(solutions: list[str]) -> dict[str, list[Any]]:
        return {"completion": [_assistant(format_sft_target(s, calculator=calculator)) for s in solutions]}

    missing = {"prompt", "solution"} - set(ds.column_names)
    if missing:
        raise DataError(f"SFT needs the 'prompt' and 'solution' columns; missing {sorted(missing)}")
    drop = [c for c in ds.column_names if c not in ("prompt", *keep_columns)]
    return ds.map(
        completions, input_columns="solution", batched=True, remove_columns=drop, desc="SFT targets"
    )


@dataclass(frozen=True)
class RFTData:
    """What an ``rft:`` stage fine-tunes on (:func:`build_rft_dataset`), and where it came from."""

    dataset: datasets.Dataset
    completions: int
    """The model's own correct completions in it."""
    prompts: int
    """Scored prompts that gave at least one."""
    replayed: int
    """Worked solutions of the run's training records mixed in."""


def build_rft_dataset(
    rows: datasets.Dataset,
    correct: Mapping[str, Sequence[str]],
    replay: datasets.Dataset,
    *,
    replay_ratio: float,
    seed: int,
    calculator: bool = False,
) -> RFTData:
    """``prompt`` + ``completion`` rows for rejection-sampling fine-tuning: each of ``correct[id]``
    (the completions of prompt ``id`` that the correctness reward paid in full) after the prompt of
    the record of ``rows`` with that ``id``, in ``rows``' order, plus ``replay_ratio`` worked solutions
    of ``replay`` (prepared records, its first ones that have a worked body before ``####``) per
    completion, shuffled together with ``seed``.

    The completions are trained on as the model wrote them, tool-written values included: the same
    text SFT writes for a worked solution in the calculator's form.

    >>> rows = datasets.Dataset.from_list([{"id": "a", "prompt": [{"role": "user", "content": "1+1?"}]}])
    >>> done = "<reasoning>\\n1+1 = 2\\n</reasoning>\\n<answer>\\n2\\n</answer>"
    >>> replay = datasets.Dataset.from_list([{"prompt": [{"role": "user", "content": "2*3?"}],
    ...                                       "solution": "2*3 = <<2*3=6>>6\\n#### 6"}] * 3)
    >>> data = build_rft_dataset(rows, {"a": [done, done.replace(" = ", "=")]}, replay, replay_ratio=1.0, seed=0)
    >>> data.completions, data.prompts, data.replayed, len(data.dataset), data.dataset.column_names
    (2, 1, 2, 4, ['prompt', 'completion'])
    """
    records = []
    prompts = 0
    for row in rows:
        texts = correct.get(str(row["id"]), ())
        prompts += bool(texts)
        records += [{"prompt": row["prompt"], "completion": _assistant(text)} for text in texts]
    if not records:
        raise DataError("rft: the scoring found no correct completion, so there is nothing to fine-tune on")
    own = datasets.Dataset.from_list(records, features=SFT_FEATURES)
    wanted = round(replay_ratio * len(records))
    worked = (
        [i for i, text in enumerate(replay["solution"]) if text.rsplit("####", 1)[0].strip()]
        if wanted
        else []
    )
    if wanted and not worked:
        # an answer alone would be replayed as "The answer follows directly from the question."
        raise DataError(
            "rft.replay: the run's training records hold answers without worked solutions, so there is "
            "nothing to replay; set rft.replay: 0"
        )
    count = min(len(worked), wanted)
    parts = [own]
    if count:
        replayed = build_sft_dataset(replay.select(worked[:count]), calculator=calculator)
        parts.append(replayed.cast(SFT_FEATURES))
    mixed = datasets.concatenate_datasets(parts).shuffle(seed=seed).flatten_indices()
    return RFTData(mixed, completions=len(records), prompts=prompts, replayed=count)


@dataclass(frozen=True)
class DpoPair:
    """One preference pair; ``chosen_score`` is ``None`` when the chosen text is the reference."""

    chosen: str
    rejected: str
    chosen_score: float | None
    rejected_score: float
    used_reference: bool = False

    @property
    def margin(self) -> float | None:
        return None if self.chosen_score is None else self.chosen_score - self.rejected_score


def _text(completion: Any) -> str:
    return completion_text(completion)


def _reference_target(reference: str) -> str:
    """A GSM8K worked solution becomes the SFT-format target; text without ``####`` is used verbatim."""
    return format_sft_target(reference) if "####" in reference else reference


def select_dpo_pair(
    completions: Sequence[Any],
    scores: Sequence[float],
    reference: str | None = None,
    *,
    correct: Sequence[bool] | None = None,
) -> DpoPair | None:
    """On-policy pair: chosen = highest-scoring completion, rejected = lowest-scoring one.

    When ``correct`` says the best completion is wrong and a ``reference`` solution is given, the
    reference (in SFT format) is chosen instead, so prompts the model cannot solve still teach
    something; this applies even if all scores tie, since the reference is not one of them. Otherwise
    a tie between best and worst gives ``None``: the pair would carry no preference. Without
    ``correct``, correctness is unknown and the reference is never used. Ties pick the first index.

    >>> select_dpo_pair(["a", "b", "c"], [0.5, 2.0, 0.0])
    DpoPair(chosen='b', rejected='c', chosen_score=2.0, rejected_score=0.0, used_reference=False)
    >>> select_dpo_pair(["a", "b"], [1.0, 1.0]) is None
    True
    """
    if not completions:
        raise DataError("select_dpo_pair needs at least one completion")
    if len(scores) != len(completions) or (correct is not None and len(correct) != len(completions)):
        raise DataError(
            f"{len(completions)} completions but {len(scores)} scores"
            + ("" if correct is None else f" and {len(correct)} correctness flags")
        )
    values = [float(s) for s in scores]
    if not all(math.isfinite(v) for v in values):
        raise DataError(f"scores must be finite numbers, got {list(scores)}")
    best = max(range(len(values)), key=values.__getitem__)
    worst = min(range(len(values)), key=values.__getitem__)
    if correct is not None and not correct[best] and reference:
        return DpoPair(_reference_target(reference), _text(completions[worst]), None, values[worst], True)
    if values[best] == values[worst]:
        return None
    return DpoPair(_text(completions[best]), _text(completions[worst]), values[best], values[worst])


def build_dpo_dataset(
    prompts: Sequence[list[dict[str, str]]],
    completions_per_prompt: Sequence[Sequence[Any]],
    scores_per_prompt: Sequence[Sequence[float]],
    correct_per_prompt: Sequence[Sequence[bool]] | None = None,
    references: Sequence[str | None] | None = None,
) -> tuple[datasets.Dataset, dict[str, Any]]:
    """A DPO dataset (``prompt``, ``chosen``, ``rejected``) and selection stats.

    Stats: ``n_prompts``, ``n_pairs``, ``dropped_ties``, ``reference_used`` and ``mean_margin``
    (mean chosen-minus-rejected score over pairs of two completions; reference pairs have no
    chosen score; 0.0 when there are none). An empty result is returned, not raised, with a warning:
    the caller decides whether a DPO stage without pairs is an error.
    """
    n = len(prompts)
    lists = {"completions_per_prompt": completions_per_prompt, "scores_per_prompt": scores_per_prompt}
    if correct_per_prompt is not None:
        lists["correct_per_prompt"] = correct_per_prompt
    if references is not None:
        lists["references"] = references
    for name, values in lists.items():
        if len(values) != n:
            raise DataError(f"{n} prompts but {len(values)} {name}")
    rows: dict[str, list[Any]] = {"prompt": [], "chosen": [], "rejected": []}
    dropped, used_reference, margins = 0, 0, []
    for i, prompt in enumerate(prompts):
        pair = select_dpo_pair(
            completions_per_prompt[i],
            scores_per_prompt[i],
            references[i] if references is not None else None,
            correct=correct_per_prompt[i] if correct_per_prompt is not None else None,
        )
        if pair is None:
            dropped += 1
            continue
        rows["prompt"].append(list(prompt))
        rows["chosen"].append(_assistant(pair.chosen))
        rows["rejected"].append(_assistant(pair.rejected))
        used_reference += pair.used_reference
        if pair.margin is not None:
            margins.append(pair.margin)
    stats = {
        "n_prompts": n,
        "n_pairs": len(rows["prompt"]),
        "dropped_ties": dropped,
        "reference_used": used_reference,
        "mean_margin": sum(margins) / len(margins) if margins else 0.0,
    }
    if not rows["prompt"]:
        logger.warning("no DPO pairs from %d prompts: every group of completions scored the same", n)
    return datasets.Dataset.from_dict(rows, features=DPO_FEATURES), stats
