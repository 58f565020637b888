"""One model built at a time in this process, whichever thread builds it.

transformers builds a model inside context managers that patch torch for the whole process, not
the calling thread: ``from_pretrained`` creates the modules on the meta device through accelerate's
``init_empty_weights`` (a patched ``nn.Module.register_parameter``) and skips their initialisation
through ``no_init_weights`` (patched ``torch.nn.init`` functions). A module another thread creates
meanwhile (a LoRA layer, a reference model, a tiny test model) gets meta or uninitialised weights:
``NotImplementedError: Cannot copy out of meta tensor`` at best, silently wrong weights at worst.
posttrain runs steps in several threads when evaluations run beside training
(``orchestration.concurrent_evals``) and when a sweep runs points side by side, so every place that
builds a model (loading, a trainer's construction, a shadow or tiny model) holds :func:`building_models`.
Training and generation themselves build nothing and run concurrently.

Two trainings do not, and neither do a training and an MLflow flush. accelerate keeps its state
(device, mixed precision, process group) in one process-wide object that every ``TrainingArguments``
resets while it sets up its devices: a trainer built for one sweep point reset it under another
point's training, which failed mid-step (`'AcceleratorState' object has no attribute
'distributed_type'`). transformers' MLflow callback logs asynchronously, and
``mlflow.flush_async_logging`` shuts MLflow's logging thread pools down before it starts new ones: a
flush at the end of another step's MLflow run made a training's next log fail (`cannot schedule new
futures after shutdown`). So a stage trains inside :func:`one_trainer_at_a_time`, and posttrain
flushes inside :func:`between_trainings`; evaluations and generation still run beside training.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

__all__ = ["between_trainings", "building_models", "one_trainer_at_a_time"]

logger = logging.getLogger(__name__)

_LOCK = threading.RLock()
_TRAINING = threading.RLock()


@contextlib.contextmanager
def building_models() -> Iterator[None]:
    """Hold the process's model-building lock (reentrant: a trainer's construction loads its model)."""
    with _LOCK:
        yield


@contextlib.contextmanager
def one_trainer_at_a_time(stage: str) -> Iterator[None]:
    """Hold the process's training lock while ``stage`` trains; say so when it waits for another."""
    if not _TRAINING.acquire(blocking=False):
        logger.info("[%s] waiting for another stage training in this process to finish", stage)
        _TRAINING.acquire()
    try:
        yield
    finally:
        _TRAINING.release()


@contextlib.contextmanager
def between_trainings() -> Iterator[None]:
    """Wait until no stage trains in this process, and keep it so for the block (an MLflow flush)."""
    with _TRAINING:
        yield
