"""A GRPO stage's prompt-pool decisions in its checkpoints, so a resumed stage goes on as before.

What posttrain's dynamic sampling decided on top of TRL's sampler lives in Python objects: the
prompts retired (``zero_signal_retire_after``, a pool refresh) and the prompts standing in for them,
the runs of flat groups counted towards retiring, where the fresh-prompt order stands, the prompts a
refresh admitted and not drawn yet, and the refresh's pool and outside-candidate cursor. Without
them a stage killed after step 8 would train its retired prompts again from step 9.

:class:`PoolCheckpoint` carries them in every checkpoint (a
:class:`~posttrain.training.checkpoint_state.CheckpointedState`). The state is store content:
checked against the stage's data and bounded (the sampler's and the refresh's ``restore``); a
malformed one is said in one warning and the stage goes on from the pool it started with.
"""

from __future__ import annotations

import logging
from typing import Any

from posttrain.training.checkpoint_state import CheckpointedState
from posttrain.training.distributed import record_state

logger = logging.getLogger(__name__)

__all__ = ["STATE_KEY", "PoolCheckpoint"]

STATE_KEY = "posttrain_prompt_pool"
FORMAT_VERSION = 1


class PoolCheckpoint(CheckpointedState):
    """Saves ``sampler``'s (posttrain.training.zero_signal.DynamicSampler) and ``refresh``'s
    (posttrain.training.pool_refresh.PoolRefresh, or None) decisions with every checkpoint and
    restores them on resume. Registered after the refresh, so a step's snapshot follows its refresh."""

    key = STATE_KEY

    def __init__(self, sampler: Any, refresh: Any = None, *, stage: str = "grpo") -> None:
        self.sampler, self.refresh, self.stage = sampler, refresh, stage

    def state(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION,
            "sampler": self.sampler.state(),
            "refresh": self.refresh.state() if self.refresh is not None else None,
        }

    def on_step_end(self, args, state, control, **kwargs):
        control = super().on_step_end(args, state, control, **kwargs)
        record_state("pool", state.stateful_callbacks[self.key])
        return control

    def restore(self, saved: Any, steps: int) -> None:
        """Go back to a :meth:`state` saved at step ``steps``; one that is not one is said in a
        warning, and then nothing changed."""
        before = self.state()
        try:
            self._apply(saved, steps)
        except (ValueError, TypeError) as exc:
            self._apply(before, steps)
            logger.warning(
                "[%s] the checkpoint of step %d holds no usable prompt-pool state (%s): going on from "
                "the pool the stage started with, so retired prompts may be trained again",
                self.stage,
                steps,
                exc,
            )
            return
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
