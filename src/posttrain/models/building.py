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
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["building_models"]

_LOCK = threading.RLock()


@contextlib.contextmanager
def building_models() -> Iterator[None]:
    """Hold the process's model-building lock (reentrant: a trainer's construction loads its model)."""
    with _LOCK:
        yield
