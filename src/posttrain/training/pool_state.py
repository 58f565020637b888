"""A GRPO stage's prompt-pool decisions in its checkpoints, so a resumed stage goes on as before.

TRL's sampler order, the weights, the optimizer and the RNG states come back from a checkpoint
through the trainer's own resume. What posttrain's dynamic sampling decided on top of that lives in
Python objects: the prompts retired (``zero_signal_retire_after``, a pool refresh) and the prompts
standing in for them, the runs of flat
groups counted towards retiring, where the fresh-prompt order stands, the prompts a refresh admitted
and not drawn yet, and the refresh's pool and outside-candidate cursor. Without them a stage killed
after step 8 would train its retired prompts again from step 9.

:class:`PoolCheckpoint` writes them at the end of every step into the trainer state's
``stateful_callbacks`` (under :data:`STATE_KEY`), which the trainer saves as the last file of a
checkpoint, so a complete checkpoint always holds the decisions of its own step; on resume it
reads them back before the first step. The state is store content: checked against the stage's
data and bounded (the sampler's and the refresh's ``restore``); a malformed one is said in one
warning and the stage goes on from the pool it started with.
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

logger = logging.getLogger(__name__)

__all__ = ["STATE_KEY", "PoolCheckpoint"]

STATE_KEY = "posttrain_prompt_pool"
FORMAT_VERSION = 1


class PoolCheckpoint(TrainerCallback):
    """Saves ``sampler``'s (posttrain.training.zero_signal.DynamicSampler) and ``refresh``'s
    (posttrain.training.pool_refresh.PoolRefresh, or None) decisions with every checkpoint and
    restores them on resume. Registered after the refresh, so a step's snapshot follows its refresh."""

    def __init__(self, sampler: Any, refresh: Any = None, *, stage: str = "grpo") -> None:
        self.sampler, self.refresh, self.stage = sampler, refresh, stage

    def snapshot(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION,
            "sampler": self.sampler.state(),
            "refresh": self.refresh.state() if self.refresh is not None else None,
        }

    def on_step_end(self, args, state, control, **kwargs):
        state.stateful_callbacks[STATE_KEY] = self.snapshot()
        return control

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step == 0:  # a fresh start: nothing to restore
            return control
        saved = (state.stateful_callbacks or {}).get(STATE_KEY)
        try:
            self.restore(saved, state.global_step)
        except (ValueError, TypeError) as exc:
            logger.warning(
                "[%s] the checkpoint of step %d holds no usable prompt-pool state (%s): going on from "
                "the pool the stage started with, so retired prompts may be trained again",
                self.stage,
                state.global_step,
                exc,
            )
        return control

    def restore(self, saved: Any, steps: int) -> None:
        """Restore a :meth:`snapshot` taken at step ``steps``; ValueError if it is not one, and then
        nothing changed."""
        before = self.snapshot()
        try:
            self._apply(saved, steps)
        except (ValueError, TypeError):
            self._apply(before, steps)
            raise
        logger.info(
            "[%s] resumed the prompt pool of step %d: %d prompts retired%s",
            self.stage,
            steps,
            len(self.sampler.retired),
            f", {len(self.refresh.scored_at)} in the refreshed pool" if self.refresh is not None else "",
        )

    def _apply(self, saved: Any, steps: int) -> None:
        if not isinstance(saved, dict) or saved.get("version") != FORMAT_VERSION:
            raise ValueError(f"not a version-{FORMAT_VERSION} prompt-pool state")
        sampler, refresh = saved.get("sampler"), saved.get("refresh")
        if not isinstance(sampler, dict) or (refresh is None) != (self.refresh is None):
            raise ValueError("the state does not match this stage's sampler and refresh")
        if self.refresh is not None:
            if not isinstance(refresh, dict):
                raise ValueError("refresh: not an object")
            self.refresh.restore(refresh, steps)
            rows_by_id = self.refresh.rows_by_id
        else:
            rows_by_id = {}
        self.sampler.restore(sampler, rows_by_id)
