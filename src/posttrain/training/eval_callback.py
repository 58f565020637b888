"""Task accuracy during GRPO training: greedy answers to a fixed held-out slice, every N steps.

The reward is what GRPO optimises, not what the user wants: a policy can raise it while answering
worse (reward hacking), and a flat reward says nothing about whether the task moved. With a stage's
``eval_every: N``, :class:`HeldoutEval` answers a fixed slice of the prepared data's held-out records
greedily when training starts (step 0), every N steps and at the last step, and logs

* ``eval/accuracy``: strict accuracy (the ``<answer>`` block matches the gold), a fraction;
* ``eval/accuracy_flexible``: the last number matches;
* ``eval/format``: share of answers in the strict XML format;
* ``eval/truncated``: share that hit ``max_completion_length`` without stopping,

as their own row of the trainer's log at that step (``Trainer.log``): the MLflow callback puts them in
the stage's run next to ``reward``, and the health monitor reads them (``reward_hacking``). Scoring is
:func:`posttrain.core.sample_score.score_completion`, the evaluator's, on the rewards' parser.

It is cheap by construction: the slice is small (``eval_limit``, default 64), prompts are tokenized
once, generation is one continuous batch of the engine (:mod:`posttrain.generation.engine`) with the
stage's ``max_completion_length``, and on a CPU in bf16 it runs on the bf16 shadow the rollouts
already use (re-synced at the step's end, which the next rollout then reuses). Greedy decoding draws
no random numbers, so training is the same with and without it. A stage with ``tools`` evaluates
with the same tools its rollouts use.

The slice is the held-out records whose ``ops`` lie in the stage's ``data_filter`` range (so reward
and accuracy measure the same difficulty; the whole held-out set if none do), first ``eval_limit``;
with a selection slice (``data.selection_size``) it is cut from that instead, so that what a stage
watches, and chooses its checkpoint by (``keep: best``), is never what the final evaluation reports.

SFT and DPO stages evaluate the same way (their ``eval_every``), generating up to the final
evaluation's ``max_completion_length``. With ``keep: best`` the trainer decides when to evaluate
(``eval_strategy``): :meth:`HeldoutEval.evaluate` stands in for ``Trainer.evaluate`` and returns
``eval_accuracy``, ... for ``metric_for_best_model`` (see :mod:`posttrain.training.selection`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

from transformers import Trainer, TrainerCallback

from posttrain.core.sample_score import score_completion
from posttrain.generation.engine import encode_prompts, generate_continuous, pad_token_id, stop_token_ids
from posttrain.generation.rollout import ShadowRollout
from posttrain.generation.tools import ChatToolLoop, make_tool

logger = logging.getLogger(__name__)

__all__ = [
    "EVAL_METRICS",
    "HeldoutEval",
    "completion_texts",
    "encode_records",
    "generation_model",
    "heldout_slice",
    "score_answers",
]

EVAL_METRICS = ("eval/accuracy", "eval/accuracy_flexible", "eval/format", "eval/truncated")
BATCH_SIZE = 64
"""Rows decoded together: the evaluator's default (``eval.batch_size``)."""


def heldout_slice(heldout: Any, data_filter: Any, limit: int) -> list[dict[str, Any]]:
    """The first ``limit`` held-out records in the stage's ``data_filter`` ops range (all if none
    are; None: no range)."""
    from posttrain.data.prepare import records_in_ops_range  # heavy (datasets): deferred until a slice is cut

    rows = heldout if data_filter is None else records_in_ops_range(heldout, data_filter)
    return [dict(rows[i]) for i in range(min(limit, len(rows)))]


def generation_model(trainer: Any, step: int) -> Any:
    """The model that generates for ``trainer``'s policy at ``step``: the rollouts' shadow copy when
    the stage has one (re-synced here, so the next rollout reuses this sync), else the policy."""
    policy = trainer.accelerator.unwrap_model(trainer.model)
    rollout = getattr(trainer, "rollout_func", None)
    if isinstance(rollout, ShadowRollout):
        return rollout.refresh(policy, step).model
    return policy


def encode_records(
    tokenizer: Any, records: Sequence[Mapping[str, Any]], tool: Any, template_kwargs: Mapping[str, Any]
) -> list[list[int]]:
    """Prompt token ids of ``records`` (``prompt`` messages), each with its own tool schema when
    ``tool`` is TRL's chat protocol."""
    if isinstance(tool, ChatToolLoop):
        return [
            encode_prompts(tokenizer, [r["prompt"]], tools=tool.tools_for(i), **template_kwargs)[0]
            for i, r in enumerate(records)
        ]
    return encode_prompts(tokenizer, [r["prompt"] for r in records], **template_kwargs)


def completion_texts(tokenizer: Any, completions: Sequence[Any], tool: Any) -> list[str]:
    """The engine's completions as text; a chat tool loop's tool turns are left out (its ``env_mask``)."""
    chat = isinstance(tool, ChatToolLoop)
    return tokenizer.batch_decode(
        [
            [t for t, m in zip(c.token_ids, c.env_mask, strict=True) if m] if chat else c.token_ids
            for c in completions
        ],
        skip_special_tokens=True,
    )


def score_answers(texts: Sequence[str], golds: Sequence[Any], finished: Sequence[bool]) -> dict[str, float]:
    """The ``eval/*`` metrics of completions ``texts`` against ``golds`` (fractions).

    >>> ok = "<reasoning>\\n1+1\\n</reasoning>\\n<answer>\\n2\\n</answer>"
    >>> score_answers([ok, "so 3", "4"], ["2", "3", "5"], [True, True, False])["eval/accuracy_flexible"]
    0.6666666666666666
    """
    scores = [
        score_completion(text, gold, truncated=not done)
        for text, gold, done in zip(texts, golds, finished, strict=True)
    ]
    n = len(scores)
    values = (
        sum(s.correct_strict for s in scores) / n,
        sum(s.correct_flexible for s in scores) / n,
        sum(s.strict_format for s in scores) / n,
        sum(s.truncated for s in scores) / n,
    )
    return dict(zip(EVAL_METRICS, values, strict=True))


class HeldoutEval(TrainerCallback):
    """Evaluates ``trainer``'s policy on ``records`` (``prompt`` messages + ``answer``) at step 0,
    every ``every`` steps and at the last step; logs :data:`EVAL_METRICS` through ``Trainer.log``."""

    def __init__(
        self,
        trainer: Any,
        records: Sequence[Mapping[str, Any]],
        every: int,
        stage: str = "grpo",
        tools: Any = None,
        *,
        max_new_tokens: int | None = None,
        scheduled: bool = True,
    ):
        """``tools`` is the stage's config (its ``tools``, ``tool_protocol``, ``environment_factory``):
        the evaluation uses the tools the rollouts use. ``max_new_tokens`` defaults to the trainer's
        ``max_completion_length`` (GRPO's). Without ``scheduled`` only the start is evaluated here;
        the trainer calls :meth:`evaluate` on its own schedule (``eval_strategy``)."""
        if not records:
            raise ValueError("in-training evaluation needs at least one held-out record")
        self.trainer, self.every, self.stage, self.scheduled = trainer, every, stage, scheduled
        self.max_new_tokens = max_new_tokens or trainer.args.max_completion_length
        tokenizer = trainer.processing_class
        template_kwargs = getattr(trainer.args, "chat_template_kwargs", None) or {}
        self.tool = None
        if tools is not None:
            self.tool = make_tool(
                tools.tools,
                tools.tool_protocol,
                tokenizer,
                stop_ids=sorted(stop_token_ids(trainer.model, tokenizer)),
                environment_factory=tools.environment_factory,
                rows=records,
                template_kwargs=template_kwargs,
            )
        self.prompt_ids = encode_records(tokenizer, records, self.tool, template_kwargs)
        self.golds = [r["answer"] for r in records]
        self.history: list[dict[str, float]] = []

    def on_train_begin(self, args, state, control, **kwargs):
        self._evaluate(state.global_step, control)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if self.scheduled and (step % self.every == 0 or step == state.max_steps):
            self._evaluate(step, control)
        return control

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: Any = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """``Trainer.evaluate``'s stand-in: evaluate now, tell the callbacks (``on_evaluate``, which
        early stopping listens to) and return ``eval_accuracy``, ``eval_accuracy_flexible``, ..."""
        trainer = self.trainer
        metrics = self._evaluate(trainer.state.global_step, trainer.control)
        named = {f"{metric_key_prefix}_{key.removeprefix('eval/')}": value for key, value in metrics.items()}
        trainer.control = trainer.callback_handler.on_evaluate(
            trainer.args, trainer.state, trainer.control, named
        )
        return named

    def _generation_model(self, step: int) -> Any:
        return generation_model(self.trainer, step)

    def _evaluate(self, step: int, control: Any) -> dict[str, float]:
        start = time.perf_counter()
        model, tokenizer = self._generation_model(step), self.trainer.processing_class
        was_training = model.training
        model.eval()
        try:
            completions, stats = generate_continuous(
                model,
                self.prompt_ids,
                max_new_tokens=self.max_new_tokens,
                stop_ids=stop_token_ids(model, tokenizer),
                pad_token_id=pad_token_id(tokenizer),
                batch_size=min(BATCH_SIZE, len(self.prompt_ids)),
                tool=self.tool,
            )
        finally:
            model.train(was_training)
        texts = completion_texts(tokenizer, completions, self.tool)
        metrics = score_answers(texts, self.golds, [c.finished for c in completions])
        self.history.append({"step": step, **metrics})
        logger.info(
            "[%s] step %d eval: strict %.1f%%, flexible %.1f%%, format %.1f%% on %d questions "
            "(%.1f s, %.0f tok/s)",
            self.stage,
            step,
            100 * metrics["eval/accuracy"],
            100 * metrics["eval/accuracy_flexible"],
            100 * metrics["eval/format"],
            len(self.golds),
            time.perf_counter() - start,
            stats.tokens_per_second,
        )
        # transformers' own Trainer.log, not GRPOTrainer.log: TRL's would flush the metrics it is
        # collecting for this step's row (and write an empty completions table) into this one. Logging
        # clears `should_log`, which the step's own row (loss, reward) still needs.
        should_log = getattr(control, "should_log", False)
        Trainer.log(self.trainer, dict(metrics))
        if control is not None:
            control.should_log = should_log
        return metrics
