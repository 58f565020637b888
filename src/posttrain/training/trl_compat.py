"""Every place posttrain reaches into TRL beyond its documented API, with the version pin that protects it.

Pinned to ``TRL_VERSIONS`` (pyproject's pin); ``tests/integration/test_compat.py`` fails when the installed version
leaves that range or when a hooked name below changes, so lifting the pin means re-checking this file.

1. ``trl.trainer.utils._use_triton`` (private), patched by :func:`compact_fused_head_on_cpu`: make
   the fused LM head project only the positions that have a label on a CPU. TRL 1.16 computes
   per-token log-probabilities with a fused, chunked LM head (``trl.trainer.utils.add_fused_lm_head``)
   for SFT, DPO and GRPO. On Triton devices it first drops the positions whose label is -100 (prompt
   and padding); on every other device it projects *all* positions onto the vocabulary and zeroes the
   unlabelled ones afterwards, because on graph-compiled accelerators (Neuron) a varying number of
   positions would recompile the graph. A CPU compiles nothing, so those projections are pure waste:
   with GSM8K prompts (~170 tokens) and 128-token GRPO completions, more than half of the vocabulary
   projection (49k x 576 per position for SmolLM2), forward and backward, is spent on prompt tokens
   whose result is thrown away. The patch switches the CPU onto the Triton devices' path (select
   labelled positions, project, scatter back), which gives the same values; it is process-wide and
   reversible.
2. ``GRPOTrainer(rollout_func=...)``: public but marked experimental (TRL warns whenever a trainer gets one). GRPO's
   CPU rollouts (:class:`posttrain.generation.rollout.ShadowRollout`) go through it rather than through
   an override of the private ``GRPOTrainer._generate_single_turn``; :func:`new_grpo_trainer` passes it
   and silences the warning. The rollout reads the trainer's public ``args``, ``processing_class``,
   ``model``, ``accelerator`` and ``state``, and returns ``posttrain.generation.rollout.ROLLOUT_KEYS``;
   ``tests/integration/test_compat.py`` runs it inside a real trainer.
3. ``SFTTrainer._total_train_tokens`` / ``DPOTrainer._total_train_tokens`` (private), set by
   :func:`carry_token_count`: the running token count those trainers log as ``num_tokens``. A
   checkpoint does not save it (GRPO's comes from the trainer state, which it does), so a resumed
   stage would count from zero; it is started from the last count the checkpoint logged.
4. ``GRPOTrainer._generate_and_score_completions(inputs)`` and ``GRPOTrainer._calculate_rewards(inputs,
   prompts, completions, completion_ids_list)`` (private), overridden by the trainer
   :func:`new_grpo_trainer` builds for a stage with ``zero_signal: drop|resample``
   (:mod:`posttrain.training.zero_signal`): the first is the one place where a generation batch is
   generated, scored and turned into the batch the loss reads (``prompt_ids``, ``completion_mask``,
   ``advantages``, ``num_items_in_batch``, ...), for TRL's own generation and for ``rollout_func``
   alike; the second is wrapped only to see the rewards matrix it returns (all processes' rows). The
   hook also reads ``reward_weights``, ``num_generations``, ``multi_objective_aggregation`` and
   appends its counts to ``_metrics["train"]``, the lists ``GRPOTrainer.log`` averages into each
   logged row (so they reach MLflow next to ``reward``). Nothing else of TRL's loop changes.
5. ``trl.trainer.grpo_trainer.print_prompt_completions_sample`` (the module's own reference to a
   utility), replaced by :func:`no_completion_tables`: with ``log_completions`` and rich installed,
   ``GRPOTrainer.log`` prints a table of sample completions on every logged step. posttrain keeps
   ``log_completions`` for the parquet files it logs to MLflow and takes the tables off the console.
"""

from __future__ import annotations

import json
import logging
import warnings
from functools import cache
from pathlib import Path
from typing import Any

from posttrain.core.errors import StageError

logger = logging.getLogger(__name__)

__all__ = [
    "TRL_VERSIONS",
    "carry_token_count",
    "compact_fused_head_on_cpu",
    "no_completion_tables",
    "new_grpo_trainer",
    "trl_metric",
]

TRL_VERSIONS = ">=1.16,<1.17"
"""The TRL versions this module was checked against (pyproject's pin)."""

_MARK = "_posttrain_compact_on_cpu"


def compact_fused_head_on_cpu(enabled: bool = True) -> bool:
    """Make TRL's fused LM head skip unlabelled positions on a CPU (``enabled=False`` restores TRL's choice).

    Returns whether the adjustment is active. A TRL without the expected hook is left untouched.
    """
    try:
        import trl.trainer.utils as trl_utils
    except ImportError:
        return False
    current = getattr(trl_utils, "_use_triton", None)
    if current is None:
        logger.debug("trl.trainer.utils._use_triton not found; fused-head adjustment skipped")
        return False
    original = getattr(current, _MARK, None)
    if not enabled:
        if original is not None:
            trl_utils._use_triton = original
        return False
    if original is not None:
        return True

    def compact_positions(device, _original=current):
        # Used by the fused head only to decide whether to drop unlabelled positions first.
        return device.type == "cpu" or _original(device)

    setattr(compact_positions, _MARK, current)
    trl_utils._use_triton = compact_positions
    return True


def no_completion_tables(enabled: bool = True) -> bool:
    """Keep GRPO's sample-completion tables off the console (``enabled=False`` puts TRL's printer
    back); returns whether they are off. A TRL without the hooked name is left untouched."""
    try:
        import trl.trainer.grpo_trainer as grpo_module
    except ImportError:
        return False
    current = getattr(grpo_module, "print_prompt_completions_sample", None)
    if current is None:
        logger.debug(
            "trl.trainer.grpo_trainer.print_prompt_completions_sample not found; tables left as they are"
        )
        return False
    original = getattr(current, _MARK, None)
    if not enabled:
        if original is not None:
            grpo_module.print_prompt_completions_sample = original
        return False
    if original is None:

        def no_table(*args: Any, **kwargs: Any) -> None:
            return None

        setattr(no_table, _MARK, current)
        grpo_module.print_prompt_completions_sample = no_table
    return True


def new_grpo_trainer(
    rollout_func: Any = None,
    zero_signal: str = "keep",
    max_rounds: int = 4,
    retire_after: int | None = None,
    refreshed: bool = False,
    **kwargs: Any,
) -> Any:
    """``trl.GRPOTrainer(**kwargs)``, with ``rollout_func`` when given and without its experimental warning.

    The warning says the hook may change without notice; the pin above and the tests are the answer.
    ``zero_signal`` ``drop`` or ``resample`` (with at most ``max_rounds`` extra generation rounds per
    batch, and prompts retired after ``retire_after`` flat groups in a row) returns the trainer with
    posttrain's dynamic sampling (hook 4 above); ``keep`` is TRL's own. ``refreshed``: a pool refresh
    retires and admits prompts (posttrain.training.pool_refresh), so the sampler needs fresh prompts.
    """
    from trl import GRPOTrainer  # heavy: deferred until a trainer is built

    cls = GRPOTrainer if zero_signal == "keep" else _dynamic_sampling_trainer()
    extra = (
        {}
        if zero_signal == "keep"
        else {
            "zero_signal": zero_signal,
            "max_rounds": max_rounds,
            "retire_after": retire_after,
            "refreshed": refreshed,
        }
    )
    if rollout_func is None:
        return cls(**kwargs, **extra)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You are using 'rollout_func'", category=UserWarning)
        return cls(rollout_func=rollout_func, **kwargs, **extra)


def carry_token_count(trainer: Any, checkpoint: str | None) -> None:
    """Start an SFT or DPO trainer's ``num_tokens`` count where ``checkpoint`` left it (no-op for
    None, or a trainer without the counter). With ``logging_steps`` above 1 the last count logged
    before the checkpoint may lag it by up to that many steps."""
    if checkpoint is None or not hasattr(trainer, "_total_train_tokens"):
        return
    state = json.loads((Path(checkpoint) / "trainer_state.json").read_text(encoding="utf-8"))
    counts = [row["num_tokens"] for row in state.get("log_history", []) if "num_tokens" in row]
    if counts:
        trainer._total_train_tokens = int(counts[-1])


def trl_metric(trainer: Any, name: str, value: float) -> None:
    """Add one value to the metric ``name`` of the trainer's next logged training row (TRL averages
    the values a row collects, as it does for ``reward``)."""
    trainer._metrics["train"][name].append(float(value))


@cache
def _dynamic_sampling_trainer() -> type:
    """The ``GRPOTrainer`` subclass for ``zero_signal: drop|resample`` (built once, on first use)."""
    from trl import GRPOTrainer  # heavy: deferred until a trainer is built

    from posttrain.generation.engine import pad_token_id
    from posttrain.training.distributed import sampler_ranks
    from posttrain.training.zero_signal import DynamicSampler, FreshPrompts, group_signal

    class DynamicSamplingGRPOTrainer(GRPOTrainer):
        """TRL's trainer with posttrain's ``zero_signal`` handling of each training generation batch."""

        def __init__(
            self,
            *args: Any,
            zero_signal: str,
            max_rounds: int,
            retire_after: int | None,
            refreshed: bool = False,
            **kwargs: Any,
        ) -> None:
            super().__init__(*args, **kwargs)
            self._posttrain_ranks = sampler_ranks(self.accelerator, pad_token_id(self.processing_class))
            refills = zero_signal == "resample" or retire_after is not None or refreshed
            fresh = FreshPrompts(self.train_dataset, self.args.seed + 1) if refills else None
            self._posttrain_sampler = DynamicSampler(
                zero_signal,
                self.num_generations,
                self._posttrain_signal,
                max_rounds=max_rounds,
                fresh=fresh,
                pad_id=pad_token_id(self.processing_class),
                retire_after=retire_after,
            )
            self._posttrain_rewards: Any = None

        def _posttrain_signal(self, rewards: Any) -> Any:
            return group_signal(
                rewards, self.reward_weights, self.num_generations, self.multi_objective_aggregation
            )

        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            self._posttrain_rewards = rewards
            return rewards

        def _posttrain_generate(self, inputs: list[dict[str, Any]]) -> tuple[dict[str, Any], Any]:
            self._posttrain_rewards = None
            batch = super()._generate_and_score_completions(inputs)
            if self._posttrain_rewards is None:
                raise StageError("zero_signal: TRL scored a batch without _calculate_rewards (TRL changed?)")
            return batch, self._posttrain_rewards

        def _generate_and_score_completions(self, inputs):
            if not self.model.training:  # evaluation batches are TRL's business
                return super()._generate_and_score_completions(inputs)
            batch, counts = self._posttrain_sampler(inputs, self._posttrain_generate, self._posttrain_ranks)
            for name, value in counts.metrics().items():
                trl_metric(self, name, value)
            return batch

    return DynamicSamplingGRPOTrainer
