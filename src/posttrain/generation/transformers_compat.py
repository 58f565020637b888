"""Every place posttrain reaches into transformers' internals: the KV-cache layer and skipped weight init.

Pinned to ``TRANSFORMERS_VERSIONS`` (pyproject's pin); ``tests/integration/test_compat.py`` fails when the installed
version leaves that range or when a hooked name below changes shape, so lifting the pin means
re-checking this file first.

1. :class:`SlotLayer` subclasses ``transformers.cache_utils.DynamicLayer``, whose contract with the
   attention code is internal: ``lazy_initialization``/``update``/``get_seq_length``/
   ``batch_select_indices`` and the attributes ``keys``, ``values``, ``is_initialized`` and ``device``
   (``DYNAMIC_LAYER_CONTRACT``). :func:`new_cache` swaps ``DynamicCache.layers`` for these layers.
   Why: ``DynamicLayer`` appends each step's keys with ``torch.cat``, which copies the whole cache on
   every decode step; with 30 layers, 32 rows and ~400 cached positions that copy costs as much as the
   attention itself on a CPU. ``SlotLayer`` keeps keys/values in a buffer with spare columns and
   writes new ones in place; attention reads a view of the filled part. The buffer only grows (by
   ``GROW`` columns at a time, amortised); a finished row costs a copy of the rows after it (in
   place, :meth:`SlotLayer.compact`: order is kept, because on a 2-core EPYC with ``avx512_bf16`` a
   reordered batch flipped 2 of 128 greedy bf16 completions late, at a near-tie), and new rows
   joining are the only full copy. Row layout is the same left padding
   ``generate`` uses: every row's real tokens end at the last filled column and the attention mask
   hides the columns before its first real token. ``tests/integration/test_eval_generation.py`` pins the result
   to ``generate`` token for token.
2. :func:`no_init_weights` is ``transformers.initialization.no_init_weights``, an internal context
   manager: the bf16 shadow policy is built from a config and every weight is overwritten right away,
   so random initialisation (~1 s for SmolLM2) is skipped.
3. :func:`packed_decode_attention` switches a model from ``sdpa`` to :data:`DECODE_ATTENTION` while the
   engine decodes, through the public ``AttentionInterface``/``AttentionMaskInterface`` registries and
   ``set_attn_implementation``; it reads the internal ``config._attn_implementation`` and delegates to
   ``transformers.integrations.sdpa_attention.sdpa_attention_forward``. Why: for one query token
   without a mask (every row of the batch starts at the same column: GRPO's G completions of one
   prompt, or a batch whose padding has been trimmed) transformers 5.24 calls SDPA with
   ``enable_gqa=True``, and torch 2.13's CPU flash kernel is several times slower on that path than
   when the query heads of one KV head are packed as rows of a longer query, which is what
   transformers itself does when a mask is present (``pack_gqa``). The result is the same attention
   (the engine's fp32 equality tests hold with it).
4. :func:`load_best_checkpoint` calls ``Trainer._load_best_model``, the end-of-training step of
   ``load_best_model_at_end``. Why: a stage whose last checkpoint marks the end of training (its
   last step, or an early stop) and that was killed while its output was written is not trained
   again on rerun (``trainer.train`` has no check before its first step, so it would train one more);
   posttrain stops it before that step and finishes as ``train`` would have, with this call.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward

logger = logging.getLogger(__name__)

__all__ = [
    "DECODE_ATTENTION",
    "DYNAMIC_LAYER_CONTRACT",
    "GROW",
    "TRANSFORMERS_VERSIONS",
    "SlotLayer",
    "load_best_checkpoint",
    "new_cache",
    "no_init_weights",
    "packed_decode_attention",
]

TRANSFORMERS_VERSIONS = ">=5.24,<5.25"
"""The transformers versions this module was checked against (pyproject's pin)."""

DYNAMIC_LAYER_CONTRACT = {
    "methods": ("lazy_initialization", "update", "get_seq_length", "batch_select_indices"),
    "attributes": ("keys", "values", "is_initialized", "device"),
}
"""What :class:`SlotLayer` overrides or sets on ``DynamicLayer`` (the test checks each still exists)."""

GROW = 64
"""Spare columns allocated whenever a layer's buffer fills up."""


def load_best_checkpoint(trainer: Any) -> None:
    """Load the best checkpoint ``trainer``'s state names into its model, as ``train()`` does at its
    end with ``load_best_model_at_end`` (item 4 above)."""
    trainer._load_best_model()


def no_init_weights() -> Any:
    """transformers' context manager that skips random weight initialisation in ``from_config``."""
    from transformers.initialization import no_init_weights as skip_init

    return skip_init()


class SlotLayer(DynamicLayer):
    """Keys/values of one attention layer in a ``[batch, heads, capacity, head_dim]`` buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self._k = key_states.new_zeros((*key_states.shape[:2], GROW, key_states.shape[-1]))
        self._v = value_states.new_zeros((*value_states.shape[:2], GROW, value_states.shape[-1]))
        self.length = 0
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        new = key_states.shape[-2]
        end = self.length + new
        if end > self._k.shape[-2]:
            self._resize(end + GROW)
        self._k[:, :, self.length : end] = key_states
        self._v[:, :, self.length : end] = value_states
        self.length = end
        self._refresh()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def _refresh(self) -> None:
        self.keys, self.values = self._k[:, :, : self.length], self._v[:, :, : self.length]

    def _resize(self, capacity: int) -> None:
        k = self._k.new_zeros((*self._k.shape[:2], capacity, self._k.shape[-1]))
        v = self._v.new_zeros((*self._v.shape[:2], capacity, self._v.shape[-1]))
        k[:, :, : self.length] = self._k[:, :, : self.length]
        v[:, :, : self.length] = self._v[:, :, : self.length]
        self._k, self._v = k, v

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._k, self._v = self._k[indices], self._v[indices]
        self._refresh()

    def compact(self, first: int, source: torch.Tensor, rows: int) -> None:
        """Rows ``first:rows`` become the rows ``source`` (all at or after ``first``); keep ``rows`` rows."""
        if len(source):
            self._k[first:rows] = self._k[source]
            self._v[first:rows] = self._v[source]
        self._k, self._v = self._k[:rows], self._v[:rows]
        self._refresh()

    def drop_leading(self, columns: int) -> None:
        """Forget the first ``columns`` positions (padding for every row); a view, no copy."""
        self._k, self._v = self._k[:, :, columns:], self._v[:, :, columns:]
        self.length -= columns
        self._refresh()

    def absorb(self, other: SlotLayer) -> None:
        """Append ``other``'s rows; the shorter side is left-padded with zeros up to the longer length."""
        length = max(self.length, other.length)
        rows = self._k.shape[0] + other._k.shape[0]
        shape = (rows, self._k.shape[1], length + GROW, self._k.shape[-1])
        k, v = self._k.new_zeros(shape), self._v.new_zeros(shape)
        for start, layer in ((0, self), (self._k.shape[0], other)):
            stop = start + layer._k.shape[0]
            k[start:stop, :, length - layer.length : length] = layer.keys
            v[start:stop, :, length - layer.length : length] = layer.values
        self._k, self._v, self.length = k, v, length
        self._refresh()


def new_cache(model: Any) -> tuple[Any, bool]:
    """An empty cache for ``model`` and whether it is made of :class:`SlotLayer` (mergeable).

    Models with sliding-window, linear-attention or shared-KV layers keep transformers' own
    layers: their columns cannot be padded and trimmed freely, so the engine then only admits new
    prompts into an empty batch.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [SlotLayer() for _ in cache.layers]
        return cache, True
    logger.info("model has non-standard cache layers; continuous batching refills only between waves")
    return cache, False


DECODE_ATTENTION = "posttrain_packed_sdpa"
"""The attention implementation :func:`packed_decode_attention` registers and switches to."""


def _packed_sdpa(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention, except one unmasked query token of a GQA layer is packed per KV head."""
    groups = getattr(module, "num_key_value_groups", 1)
    plain = not dropout and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
    if query.shape[2] == 1 and attention_mask is None and groups > 1 and plain:
        batch, heads, _, dim = query.shape
        packed = query.reshape(batch, heads // groups, groups, dim)  # head h reads KV head h // groups
        out = F.scaled_dot_product_attention(packed, key, value, scale=scaling)
        return out.reshape(batch, heads, 1, value.shape[-1]).transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(
        module,
        query,
        key,
        value,
        attention_mask,
        dropout=dropout,
        scaling=scaling,
        is_causal=is_causal,
        **kwargs,
    )


@cache
def _register_packed_sdpa() -> None:
    """Add :data:`DECODE_ATTENTION` to transformers' registries, once per process."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(DECODE_ATTENTION, _packed_sdpa)
    AttentionMaskInterface.register(DECODE_ATTENTION, sdpa_mask)


@contextmanager
def packed_decode_attention(model: Any) -> Iterator[None]:
    """Decode ``model`` with :data:`DECODE_ATTENTION` inside the block when it uses ``sdpa`` (else unchanged)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if getattr(config, "_attn_implementation", None) != "sdpa" or not hasattr(
        base, "set_attn_implementation"
    ):
        yield
        return
    _register_packed_sdpa()
    base.set_attn_implementation(DECODE_ATTENTION)
    try:
        yield
    finally:
        base.set_attn_implementation("sdpa")
