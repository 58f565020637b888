"""Measure how often a model solves each candidate prompt of a GRPO stage (its ``score-<stage>`` step).

k completions per prompt are sampled through the evaluator's engine, at the stage's temperature,
completion length, tools and chat-template options (``chat_template_kwargs``): the engine prefills
a prompt once and decodes its k rows from that prefill, so scoring runs at evaluation speed. Each
completion is scored with the ``correctness`` reward the stage pays (the evaluator's strict
parser), so a prompt's pass rate is the share of its group that would have earned the full
correctness reward in a rollout of the same policy.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.core.config import EvalConfig, GRPOStageConfig
from posttrain.data.pass_rates import PassRates, correct_counts
from posttrain.evaluation.evaluator import evaluate
from posttrain.evaluation.report import EvalReport
from posttrain.rewards.accuracy import correctness_reward

logger = logging.getLogger(__name__)

__all__ = ["PassRateScoring", "correct_completions", "score_pass_rates", "scoring_config"]

SCORING_BATCH = 64
"""Rows decoded together while scoring (the evaluator's default batch)."""


@dataclass(frozen=True)
class PassRateScoring:
    """The pass rates, and the report of the k samples they were counted from (timings, texts)."""

    rates: PassRates
    report: EvalReport


def scoring_config(stage_cfg: GRPOStageConfig, seed: int) -> EvalConfig:
    """The evaluation settings that sample like the stage's rollouts: its temperature, completion
    length, tools and tool protocol; seeded by the run's ``seed``."""
    assert stage_cfg.pass_rate is not None, "only a stage with pass_rate: is scored"
    options = stage_cfg.trainer_options()
    return EvalConfig(
        temperature=float(options.get("temperature", 1.0)),
        max_completion_length=int(options["max_completion_length"]),
        batch_size=SCORING_BATCH,
        tools=list(stage_cfg.tools),
        tool_protocol=stage_cfg.tool_protocol,
        environment_factory=stage_cfg.environment_factory,
        seed=seed,
        limit=None,  # every candidate the step hands over (an evaluation's default keeps 100)
    )


def score_pass_rates(
    model: Any,
    rows: Sequence[Mapping[str, Any]] | Any,
    stage_cfg: GRPOStageConfig,
    *,
    seed: int,
    precision: str | None = None,
    system_prompt: str | None = None,
    few_shot: Sequence[Mapping[str, Any]] = (),
    progress: bool = False,
) -> PassRateScoring:
    """k completions of every row in ``rows`` (prepared records: ``id``, ``question``, ``answer``,
    ``prompt``) from ``model``, each scored by ``correctness_reward``; the correct count per id."""
    assert stage_cfg.pass_rate is not None, "only a stage with pass_rate: is scored"
    k = stage_cfg.pass_rate.samples
    report = evaluate(
        model,
        rows,
        scoring_config(stage_cfg, seed),
        precision=precision,
        num_samples=k,
        data_name=f"{stage_cfg.step_name} candidates",
        system_prompt=system_prompt,
        few_shot=few_shot,
        progress=progress,
        template_kwargs=stage_cfg.trainer_options().get("chat_template_kwargs"),
    )
    answers = {str(row["id"]): row["answer"] for row in rows}
    scores = [
        correctness_reward([s.completion for s in r.samples], [answers[r.id]] * len(r.samples))
        for r in report.records
    ]
    rates = PassRates(samples=k, correct=correct_counts([r.id for r in report.records], scores))
    logger.info(
        "[score-%s] %d prompts × %d completions: prompts by correct completions %s",
        stage_cfg.step_name,
        len(rates.correct),
        k,
        rates.histogram(),
    )
    return PassRateScoring(rates, report)


def correct_completions(report: EvalReport, answers: Mapping[str, Any]) -> dict[str, list[str]]:
    """Each scored prompt's distinct completions that the ``correctness`` reward pays in full (the ones
    its pass rate counts), in sampling order, by id; ``answers`` holds each id's gold answer. A
    completion cut off at the length limit is left out: trained on, it would end where the model
    never stopped."""
    correct: dict[str, list[str]] = {}
    for record in report.records:
        samples = record.samples
        texts = [s.completion for s in samples]
        scores = correctness_reward(texts, [answers[record.id]] * len(texts))
        paid = [
            s.completion for s, score in zip(samples, scores, strict=True) if score == 1.0 and not s.truncated
        ]
        correct[record.id] = list(dict.fromkeys(paid))
    return correct
