"""Tools the generation engine runs inside a completion: the inline calculator.

A tool here is text-protocol only: it reads what a row has written and may force tokens into it
(:class:`posttrain.generation.engine.EngineTool`), so it works with any model and tokenizer, needs
no tool-calling chat template, and is the same in evaluation, DPO's on-policy sampling, GRPO's
rollouts and the in-training evaluation. What counts as a call, and what the calculator writes, is
:mod:`posttrain.core.calculator`'s; this module only moves between text and token ids.

TRL's own tool loop (``GRPOTrainer(tools=...)``, for models whose chat template renders tool
calls) is a different protocol; :mod:`posttrain.training.grpo` passes it through.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from posttrain.core.calculator import calculator_call
from posttrain.generation.engine import EngineTool, ToolCall

logger = logging.getLogger(__name__)

__all__ = ["ENGINE_TOOLS", "Calculator", "engine_tool"]

ENGINE_TOOLS = ("calculator",)
"""Tools the engine runs (``tools:`` in a stage or evaluation section)."""

WINDOW = 64
"""Completion tokens decoded to look for a call: far more than one step's expression needs."""


def _trigger_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the tokens whose text ends in ``=`` (spaces allowed after it): the only tokens after
    which a completion can end in a call. Found from the vocabulary once, so the engine asks the
    calculator only after those tokens instead of decoding every row on every step."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    candidates = [i for i, piece in enumerate(pieces) if piece and ("=" in piece or "<0x3D>" in piece)]
    texts = tokenizer.batch_decode([[i] for i in candidates])
    return frozenset(i for i, text in zip(candidates, texts, strict=True) if text.rstrip(" \t").endswith("="))


class Calculator:
    """The inline calculator (:func:`posttrain.core.calculator.calculator_call`) as an engine tool.

    After a token ending in ``=``, the completion's last :data:`WINDOW` tokens are decoded; when
    they end in an arithmetic expression (or an open GSM8K annotation), the value's tokens are
    returned to be forced. A call the calculator cannot compute (``2**99 =``, ``1/0 =``) is a failed
    call: counted, nothing forced.
    """

    name = "calculator"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.triggers = _trigger_ids(tokenizer)
        if not self.triggers:
            logger.warning("calculator: the tokenizer has no token ending in '='; it will never be called")

    def __call__(self, token_ids: Sequence[int]) -> ToolCall | None:
        text = self.tokenizer.decode(list(token_ids[-WINDOW:]), skip_special_tokens=True)
        call = calculator_call(text)
        if call is None:
            return None
        if not call.ok:
            return ToolCall((), False)
        return ToolCall(tuple(self.tokenizer.encode(call.insert, add_special_tokens=False)), True)


def engine_tool(names: Sequence[str], tokenizer: Any) -> EngineTool | None:
    """The engine tool for a section's ``tools:`` list (None for an empty list)."""
    unknown = [n for n in names if n not in ENGINE_TOOLS]
    if unknown:
        raise ValueError(f"unknown engine tool(s) {unknown}; known: {list(ENGINE_TOOLS)}")
    return Calculator(tokenizer) if "calculator" in names else None
