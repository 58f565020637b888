"""Sampling several completions per prompt from a policy, for on-policy DPO pairs.

The evaluation package's continuous-batching engine is used when it is importable: DPO samples
vary a lot in length, and a static ``generate`` batch keeps decoding rows long after they emitted
EOS. Plain ``generate`` is the fallback (same sampling distribution: temperature only, no top-k/p).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["Samples", "sample_completions"]


@dataclass(frozen=True)
class Samples:
    texts: list[list[str]]
    """``texts[i][j]``: completion ``j`` of prompt ``i`` (special tokens removed)."""
    token_ids: list[list[list[int]]]
    seconds: float
    engine: str

    @property
    def generated_tokens(self) -> int:
        return sum(len(ids) for group in self.token_ids for ids in group)


def _encode(tokenizer: Any, prompts: Sequence[Sequence[dict[str, str]]]) -> list[list[int]]:
    # Render to text then tokenize without special tokens: templates that write their own BOS would get two.
    texts = [
        tokenizer.apply_chat_template(list(p), tokenize=False, add_generation_prompt=True) for p in prompts
    ]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def _stop_ids(model: Any, tokenizer: Any) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids = {eos} if isinstance(eos, int) else set(eos or [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def _generate_static(model, prompt_ids, *, stop_ids, pad_token_id, max_new_tokens, temperature, batch_size):
    from transformers import GenerationConfig

    from posttrain.generation.rollout import generate_completion_ids

    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        pad_token_id=pad_token_id,
        eos_token_id=stop_ids,
    )
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))  # similar lengths pad less
    out: list[list[int]] = [[] for _ in prompt_ids]
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        generated = generate_completion_ids(
            model, [prompt_ids[i] for i in chunk], config, pad_token_id, stop_ids
        )
        for index, ids in zip(chunk, generated, strict=True):
            out[index] = ids
    return out


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
) -> Samples:
    """``n`` sampled completions for each chat prompt, in prompt order."""
    import torch

    prompt_ids = _encode(tokenizer, prompts)
    flat = [ids for ids in prompt_ids for _ in range(n)]
    stop_ids = _stop_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    start = time.perf_counter()
    try:
        from posttrain.generation.engine import generate_continuous
    except ImportError:
        generate_continuous = None
    if generate_continuous is not None:
        completions, _ = generate_continuous(
            model,
            flat,
            max_new_tokens=max_new_tokens,
            stop_ids=stop_ids,
            pad_token_id=pad,
            batch_size=batch_size,
            temperature=temperature,
            seeds=[seed * 1_000_003 + i for i in range(len(flat))],
            progress=True,
            desc="sampling",
        )
        ids = [list(c.token_ids) for c in completions]
        engine = "continuous"
    else:
        torch.manual_seed(seed)
        ids = _generate_static(
            model,
            flat,
            stop_ids=stop_ids,
            pad_token_id=pad,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            batch_size=batch_size,
        )
        engine = "generate"
    seconds = time.perf_counter() - start
    texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    grouped_ids = [ids[i * n : (i + 1) * n] for i in range(len(prompts))]
    grouped_texts = [texts[i * n : (i + 1) * n] for i in range(len(prompts))]
    samples = Samples(grouped_texts, grouped_ids, seconds, engine)
    logger.info(
        "sampled %d x %d completions (%d tokens) in %.1f s with %s",
        len(prompts),
        n,
        samples.generated_tokens,
        seconds,
        engine,
    )
    return samples
