"""A CPU-only adjustment to TRL's fused LM head: project only the positions that have a label.

TRL 1.16 computes per-token log-probabilities with a fused, chunked LM head
(``trl.trainer.utils.add_fused_lm_head``) for SFT, DPO and GRPO. On Triton devices it first drops the
positions whose label is -100 (prompt and padding); on every other device it projects *all*
positions onto the vocabulary and zeroes the unlabelled ones afterwards, because on graph-compiled
accelerators (Neuron) a varying number of positions would recompile the graph. A CPU compiles
nothing, so those projections are pure waste: with GSM8K prompts (~170 tokens) and 128-token GRPO
completions, more than half of the vocabulary projection (49k x 576 per position for SmolLM2),
forward and backward, is spent on prompt tokens whose result is thrown away.

:func:`compact_fused_head_on_cpu` switches the CPU onto the Triton devices' path (select labelled
positions, project, scatter back), which gives the same values. The switch is process-wide and
touches one private TRL function, so it is guarded by the pinned TRL version and checked by a test.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

__all__ = ["compact_fused_head_on_cpu"]

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
