"""Library warnings a user can do nothing about, kept off a run's terminal.

They concern how one library calls another (transformers' deprecations that TRL's own calls
trigger) or schema inference on posttrain's own tables. Every process that runs posttrain's work
installs the same filters: the CLI, and each process ``accelerate launch`` starts for a stage
(posttrain.pipeline.stage_main), which would otherwise print them once per rank and stage.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["QUIET_WARNINGS", "one_line_per_library_record", "quiet_library_warnings"]

QUIET_WARNINGS = (
    ("ignore", r"Hint: Inferred schema contains integer column", UserWarning, ""),
    ("ignore", r".*", FutureWarning, r"transformers(\.|$)"),
)
"""(action, message, category, module) for :func:`warnings.filterwarnings`."""


def quiet_library_warnings() -> None:
    """Install :data:`QUIET_WARNINGS` in this process."""
    for action, message, category, module in QUIET_WARNINGS:
        warnings.filterwarnings(action, message=message, category=category, module=module)


def one_line_per_library_record() -> None:
    """Print huggingface_hub's log records once, through the root logger's handler.

    huggingface_hub gives its logger a handler of its own and lets records propagate too, so under a
    process that configures the root logger each hub retry would be printed twice, once without a time.
    """
    import huggingface_hub.utils.logging  # noqa: F401  # installs its handler, once per process

    library = logging.getLogger("huggingface_hub")
    for handler in library.handlers[:]:
        library.removeHandler(handler)
