"""Every place posttrain reaches into torch's internals: oneDNN's prepacked linear weights.

Pinned to ``TORCH_VERSIONS`` (pyproject's pin); ``tests/integration/test_compat.py`` fails when the installed
version leaves that range or when a hooked op below disappears, so lifting the pin means re-checking
this file first.

:func:`packed_linear_weights` runs every plain ``nn.Linear`` of a bf16 model on the CPU through
``torch.ops.mkldnn._reorder_linear_weight`` (the weight laid out once in oneDNN's blocked format) and
``torch.ops.mkldnn._linear_pointwise`` (the matmul on that layout), the pair ``torch.compile``'s
inductor emits for a frozen bf16 linear on the CPU (``torch/_inductor/fx_passes/mkldnn_fusion.py``).
Why: a plain bf16 ``F.linear`` makes oneDNN reorder the weight on every call, so a decode step's
small matmuls run far below the rate of the same shapes with the weight laid out once, and the
tokens do not change (docs/results/2026-12-01-decode-experiments.md has the timings). Packing is
cheap next to a generation call, so it is done on entry to each one, which also keeps it current
while training changes the weights between calls. Only inference uses it: the packed op has no
autograd.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch

__all__ = ["TORCH_VERSIONS", "bf16_prepack_supported", "packable_linears", "packed_linear_weights"]

TORCH_VERSIONS = ">=2.6,<2.14"
"""The torch versions this module was checked against (pyproject's pin)."""

PACK_ROWS_HINT = 64
"""The row count oneDNN lays the weights out for (the evaluator's default batch); any count works."""


@cache
def bf16_prepack_supported() -> bool:
    """oneDNN is built in and runs bf16 natively on this CPU (what inductor checks before packing)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch build without the ops
        return False


def packable_linears(model: Any) -> list[torch.nn.Linear]:
    """The plain bf16 CPU ``nn.Linear`` modules of ``model`` (not subclasses: 4-bit or adapter layers)."""
    if not bf16_prepack_supported():
        return []
    return [
        module
        for module in model.modules()
        if type(module) is torch.nn.Linear
        and module.weight.dtype == torch.bfloat16
        and module.weight.device.type == "cpu"
    ]


def _packed_forward(weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

    return forward


@contextmanager
def packed_linear_weights(model: Any) -> Iterator[int]:
    """Inside the block (inference only), ``model``'s bf16 CPU linears use prepacked weights; yields how many.

    The instance attribute ``forward`` shadows ``nn.Linear.forward`` and is removed on exit, so the
    module is unchanged afterwards; weights are packed on entry, from their values at that moment.
    """
    linears = packable_linears(model)
    for module in linears:
        packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), PACK_ROWS_HINT)
        bias = module.bias.detach() if module.bias is not None else None
        module.forward = _packed_forward(packed, bias)
    try:
        yield len(linears)
    finally:
        for module in linears:
            module.__dict__.pop("forward", None)
