"""What a stage carries in its checkpoints beyond the trainer's own state, so a resumed stage goes on
as the uninterrupted one would.

The trainer restores weights, optimizer, scheduler, RNG states and its ``TrainerState`` from a
checkpoint. :class:`CheckpointedState` is how posttrain's own objects ride along: at every step end
it writes a JSON value into the trainer state's ``stateful_callbacks`` (under its :attr:`key`),
which the trainer saves as the last file of a checkpoint, so a complete checkpoint always holds the
value of its own step; when training resumes from one, it hands the value back to :meth:`restore`
before the first step. The value is store content: each ``restore`` checks and bounds it.

:class:`StageClock` is the stage's seconds: the minutes a run reports for a stage (``stage.json``'s
``duration_s``, the summary's minutes and points per minute) would otherwise leave out everything
before a kill. The prompt pool of a GRPO stage is another (posttrain.training.pool_state).
"""

from __future__ import annotations

import time
from typing import Any

from transformers import TrainerCallback

__all__ = ["CLOCK_KEY", "CheckpointedState", "StageClock"]


class CheckpointedState(TrainerCallback):
    """A value saved with every checkpoint under :attr:`key` and restored on resume."""

    key: str

    def state(self) -> Any:
        """The value to save, as JSON values."""
        raise NotImplementedError

    def restore(self, saved: Any, steps: int) -> None:
        """Take back ``saved`` (None when the checkpoint holds none), read from the checkpoint of
        step ``steps``."""
        raise NotImplementedError

    def on_step_end(self, args, state, control, **kwargs):
        state.stateful_callbacks[self.key] = self.state()
        return control

    def on_train_begin(self, args, state, control, **kwargs):
        if state.global_step > 0:  # resumed from a checkpoint
            self.restore((state.stateful_callbacks or {}).get(self.key), state.global_step)
        return control


CLOCK_KEY = "posttrain_stage_seconds"
_MOST = 1e8
"""Seconds (three years) beyond which a saved value is not a stage's: store content, so bounded."""


class StageClock(CheckpointedState):
    """The stage's seconds: this process's since ``started`` (a ``time.perf_counter`` value) plus
    those its checkpoint recorded before a kill (:attr:`before`). A resumed stage so costs what an
    uninterrupted one would, plus the reload and the steps retrained since the checkpoint."""

    key = CLOCK_KEY

    def __init__(self, started: float) -> None:
        self.started = started
        self.before = 0.0

    def seconds(self) -> float:
        return self.before + time.perf_counter() - self.started

    def state(self) -> float:
        return round(self.seconds(), 3)

    def restore(self, saved: Any, steps: int) -> None:
        if type(saved) in (int, float) and 0 <= saved <= _MOST:
            self.before = float(saved)
