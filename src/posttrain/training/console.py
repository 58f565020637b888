"""What a training stage prints: a progress bar and a few lines, not a table per step.

transformers' ``ProgressCallback`` writes every logged step's metrics dict under the bar (a line of
dozens of keys per step), and TRL's GRPO trainer prints a rich table of sample completions on every
logged step (about 1,500 box-drawing lines in a 15-minute three-stage curriculum). Both already go
elsewhere: the metrics to MLflow and the stage's ``log_history.jsonl``, the completions to
``completions/*.parquet`` and the stage run's MLflow table. So the bar shows the loss and the reward,
and the completion tables stay off the console (:func:`posttrain.training.trl_compat.no_completion_tables`).
"""

from __future__ import annotations

from typing import Any

from transformers.trainer_callback import PrinterCallback, ProgressCallback

__all__ = ["QuietProgress", "quiet_console"]


class QuietProgress(ProgressCallback):
    """The progress bar, with the loss, reward and in-training accuracy as its postfix instead of a line per step."""

    SHOWN = ("loss", "reward", "eval/accuracy")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and self.training_bar is not None and logs:
            shown = {k: f"{v:.3g}" for k, v in logs.items() if k in self.SHOWN and isinstance(v, int | float)}
            if shown:
                self.training_bar.set_postfix(shown, refresh=False)


def quiet_console(trainer: Any) -> Any:
    """Swap ``trainer``'s line-per-step printing for :class:`QuietProgress` (no bar with ``disable_tqdm``)."""
    trainer.remove_callback(PrinterCallback)
    if trainer.pop_callback(ProgressCallback) is not None:
        trainer.add_callback(QuietProgress)
    return trainer
