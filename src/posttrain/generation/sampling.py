"""Sampling several completions per prompt from a policy, for on-policy DPO pairs.

The samples come from the same continuous-batching engine evaluation uses
(:func:`posttrain.generation.engine.generate_continuous`): DPO samples vary a lot in length, and a
static ``generate`` batch keeps decoding rows long after they emitted EOS. Sampling is plain
temperature sampling with one seed per sample, so a sample does not depend on the batch it shared.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from posttrain.generation.engine import (
    GenerationStats,
    encode_prompts,
    generate_continuous,
    pad_token_id,
    stop_token_ids,
)
from posttrain.generation.tools import engine_tool

logger = logging.getLogger(__name__)

__all__ = ["Samples", "sample_completions", "sample_seeds"]


@dataclass(frozen=True)
class Samples:
    texts: list[list[str]]
    """``texts[i][j]``: completion ``j`` of prompt ``i`` (special tokens removed)."""
    token_ids: list[list[list[int]]]
    seconds: float
    stats: GenerationStats | None = None

    @property
    def generated_tokens(self) -> int:
        return sum(len(ids) for group in self.token_ids for ids in group)

    def tool_metrics(self) -> dict[str, float]:
        """How often the samples called a tool, and how often a call failed (TRL's names)."""
        return self.stats.tool_metrics() if self.stats is not None else {}


def sample_seeds(seed: int, count: int) -> list[int]:
    """One seed per sample, distinct across runs seeded one apart (up to a million samples per run).

    >>> sample_seeds(1, 3)
    [1000003, 1000004, 1000005]
    """
    return [seed * 1_000_003 + i for i in range(count)]


def sample_completions(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[dict[str, str]]],
    n: int,
    *,
    temperature: float,
    max_new_tokens: int,
    seed: int = 0,
    batch_size: int = 32,
    tools: Sequence[str] = (),
) -> Samples:
    """``n`` sampled completions for each chat prompt, in prompt order; ``tools`` (engine tools, e.g.
    the calculator) run inside the completions as they do in evaluation and GRPO."""
    prompt_ids = encode_prompts(tokenizer, prompts)
    flat = [ids for ids in prompt_ids for _ in range(n)]
    completions, stats = generate_continuous(
        model,
        flat,
        max_new_tokens=max_new_tokens,
        stop_ids=stop_token_ids(model, tokenizer),
        pad_token_id=pad_token_id(tokenizer),
        batch_size=batch_size,
        temperature=temperature,
        seeds=sample_seeds(seed, len(flat)),
        progress=True,
        desc="sampling",
        tool=engine_tool(tools, tokenizer),
    )
    ids = [list(c.token_ids) for c in completions]
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    samples = Samples(
        [texts[i * n : (i + 1) * n] for i in range(len(prompts))],
        [ids[i * n : (i + 1) * n] for i in range(len(prompts))],
        stats.seconds,
        stats,
    )
    logger.info(
        "sampled %d x %d completions (%d tokens) in %.1f s (%.0f tok/s)",
        len(prompts),
        n,
        samples.generated_tokens,
        stats.seconds,
        stats.tokens_per_second,
    )
    return samples
