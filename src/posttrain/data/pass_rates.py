"""Per-prompt pass rates: the file a ``score-<stage>`` step leaves, and the prompts a stage keeps by them.

A GRPO group whose completions all succeed or all fail has zero advantage everywhere: it costs a
full rollout and teaches nothing. A stage with ``pass_rate:`` trains only on prompts its input
model solved sometimes but not always when they were scored (posttrain.evaluation.pass_rate
measures them), optionally drawn in proportion to p(1-p).

The file is store content, so it is read as untrusted input: bounded, parsed with :mod:`json`,
every field checked; anything else is a :class:`PassRateFileError` (the step is recomputed).
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.core.config import PassRateConfig
from posttrain.core.errors import PosttrainError
from posttrain.core.untrusted import UntrustedContentError, read_json_bounded

__all__ = [
    "PASS_RATES_FILE",
    "PassRateFileError",
    "PassRates",
    "correct_counts",
    "kept_ids",
    "select_by_pass_rate",
]

PASS_RATES_FILE = "pass_rates.json"
FORMAT_VERSION = 1
_MAX_BYTES = 32 << 20  # a few hundred thousand prompts; a bigger file is not ours
MAX_SAMPLES = 1024
"""Completions per prompt a scoring may sample (``pass_rate.samples``), as for ``eval.pass_k``."""


class PassRateFileError(PosttrainError, ValueError):
    """A pass-rate file that is missing, malformed or not posttrain's."""


@dataclass(frozen=True)
class PassRates:
    """How many of ``samples`` completions of each prompt (by id) were correct."""

    samples: int
    correct: Mapping[str, int]

    def rate(self, prompt_id: str) -> float:
        return self.correct[prompt_id] / self.samples

    def rates(self) -> dict[str, float]:
        return {pid: n / self.samples for pid, n in self.correct.items()}

    def histogram(self) -> list[int]:
        """Prompts with 0, 1, ..., ``samples`` correct completions."""
        counts = [0] * (self.samples + 1)
        for n in self.correct.values():
            counts[n] += 1
        return counts

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / PASS_RATES_FILE
        body = {
            "posttrain_pass_rates": FORMAT_VERSION,
            "samples": self.samples,
            "correct": dict(self.correct),
        }
        # Written into the step's staging folder, which becomes the output in one rename.
        path.write_text(json.dumps(body, indent=1, sort_keys=True), encoding="utf-8")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> PassRates:
        """Read and check ``directory``'s pass-rate file (bounded; every count an int in 0..samples)."""
        path = Path(directory) / PASS_RATES_FILE
        try:
            data = read_json_bounded(path, max_bytes=_MAX_BYTES)
        except FileNotFoundError:
            raise PassRateFileError(f"{path}: no pass-rate file") from None
        except UntrustedContentError as exc:
            raise PassRateFileError(f"{exc}: not a pass-rate file") from None
        if not isinstance(data, dict) or data.get("posttrain_pass_rates") != FORMAT_VERSION:
            raise PassRateFileError(f"{path}: not a posttrain pass-rate file (version {FORMAT_VERSION})")
        samples, correct = data.get("samples"), data.get("correct")
        if type(samples) is not int or not 1 <= samples <= MAX_SAMPLES or not isinstance(correct, dict):
            raise PassRateFileError(
                f"{path}: samples must be an int in 1..{MAX_SAMPLES} and correct an object"
            )
        for pid, n in correct.items():
            if type(n) is not int or not 0 <= n <= samples:
                raise PassRateFileError(f"{path}: correct.{pid}: {n!r} is not an int in 0..{samples}")
        return cls(samples=samples, correct=dict(correct))


def kept_ids(rates: PassRates, cfg: PassRateConfig) -> list[str]:
    """Ids of the scored prompts whose pass rate lies strictly inside ``cfg.band``, in file order.

    >>> kept_ids(PassRates(4, {"a": 0, "b": 2, "c": 4, "d": 1}), PassRateConfig(samples=4))
    ['b', 'd']
    """
    return [pid for pid, n in rates.correct.items() if cfg.keeps(n / rates.samples)]


def select_by_pass_rate(dataset: Any, rates: PassRates, cfg: PassRateConfig, seed: int) -> Any:
    """The rows of ``dataset`` (a ``datasets.Dataset`` with ``id``) a stage trains on: those in the band,
    in the dataset's order (``uniform``), or as many draws with replacement weighted by p(1-p)
    (``variance``, seeded by ``seed``). Rows that were not scored never train."""
    keep = set(kept_ids(rates, cfg))
    index = [i for i, pid in enumerate(dataset["id"]) if str(pid) in keep]
    if cfg.weighting == "variance" and index:
        weights = [_variance(rates.rate(str(dataset[i]["id"]))) for i in index]
        index = random.Random(seed).choices(index, weights=weights, k=len(index))
    return dataset.select(index)


def _variance(p: float) -> float:
    """p(1-p): a Bernoulli reward's variance, the expected spread of a group's rewards.

    >>> _variance(0.5), _variance(0.25), _variance(1.0)
    (0.25, 0.1875, 0.0)
    """
    return p * (1.0 - p)


def correct_counts(ids: Sequence[str], scores: Sequence[Sequence[float | None]]) -> dict[str, int]:
    """Each prompt's number of completions a reward paid in full (score 1.0), by id.

    >>> correct_counts(["a", "b"], [[1.0, 0.0, None], [1.0, 1.0, 1.0]])
    {'a': 1, 'b': 3}
    """
    return {str(pid): sum(1 for s in group if s == 1.0) for pid, group in zip(ids, scores, strict=True)}
