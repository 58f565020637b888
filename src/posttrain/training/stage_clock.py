"""A stage's minutes across a kill: the seconds it had spent by each checkpoint travel in that checkpoint.

A resumed stage's own process only sees the time since it started again; the minutes a run reports
for the stage (``stage.json``'s ``duration_s``, the summary's minutes and points per minute) would
leave out everything before the kill. :class:`StageClock` writes the stage's seconds so far into the
trainer state at every step end (``stateful_callbacks``, saved as the last file of a checkpoint), and
reads them back when training resumes from one, so a resumed stage costs what an uninterrupted one
would, plus the reload and the steps retrained since the checkpoint.
"""

from __future__ import annotations

import time

from transformers import TrainerCallback

__all__ = ["CLOCK_KEY", "StageClock"]

CLOCK_KEY = "posttrain_stage_seconds"
_MOST = 1e8
"""Seconds (three years) beyond which a saved value is not a stage's: store content, so bounded."""


class StageClock(TrainerCallback):
    """The stage's seconds: this process's since ``started`` (a ``time.perf_counter`` value) plus
    those its checkpoint recorded before a kill (:attr:`before`)."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.before = 0.0

    def seconds(self) -> float:
        return self.before + time.perf_counter() - self.started

    def on_train_begin(self, args, state, control, **kwargs):
        saved = (state.stateful_callbacks or {}).get(CLOCK_KEY)
        if state.global_step > 0 and type(saved) in (int, float) and 0 <= saved <= _MOST:
            self.before = float(saved)
        return control

    def on_step_end(self, args, state, control, **kwargs):
        state.stateful_callbacks[CLOCK_KEY] = round(self.seconds(), 3)
        return control
