"""Continuous-batching generation over a Hugging Face causal LM, for fast evaluation on CPU or GPU.

Why not ``model.generate`` on padded batches: a static batch keeps decoding every row until the
*longest* one stops or hits ``max_new_tokens``. GSM8K completions vary from 40 to 256+ tokens, so most
of a static batch's compute goes to rows that already emitted EOS. This engine runs its own decode
loop on the model's KV cache instead:

* prompts are sorted longest first, so the prompts prefilled together have similar lengths;
* after every step, finished rows leave the batch (their cache rows are dropped), so no compute is
  spent after EOS;
* when the batch has shrunk to ``refill_at * batch_size`` rows, waiting prompts are prefilled
  together and merged into the running cache. The two caches have different lengths; the shorter
  one is left-padded with zeros that the attention mask hides, which is the same left padding
  ``generate`` uses, and positions are counted per row from its real tokens, so each sequence sees
  exactly what it would see alone. Refilling in waves rather than on every freed slot amortises
  the cost of a prefill call and of copying the cache;
* cache columns that are padding for every remaining row are trimmed, so attention does not keep
  paying for a long prompt that has already left;
* a prefill runs identical prompts once, and the prefix its distinct prompts share (the system
  prompt and chat template) once, copying their keys and values to every row.

Greedy decoding takes the argmax of the same logits ``generate`` computes, so the tokens match it
(tests check it on fp32 against one ``generate`` call per prompt). Sampling is plain temperature
sampling (no top-k/top-p, unlike ``generate``'s defaults) by inverse CDF, one uniform per token from
the sequence's own generator, seeded by the caller, so a sample does not depend on which other
sequences shared its batch.

A ``tool`` (:mod:`posttrain.generation.tools`, e.g. the inline calculator) may write tokens into a
row: after a model token in the tool's ``triggers`` the tool reads the row's completion and may
return tokens to force; the row then takes those tokens one per decode step instead of sampling
(its logits are computed and ignored, so a call costs one decode step per forced token and the
batch keeps one shape), and continues from there. Forced tokens are marked 0 in the completion's
``env_mask`` (TRL's ``rollout_func`` contract: model tokens 1, external tokens 0). A row that never
triggers a call decodes exactly as it would without the tool.

Evaluation, DPO's on-policy sampling (:mod:`posttrain.generation.sampling`) and GRPO's CPU rollouts
(:mod:`posttrain.generation.rollout`) all generate here, with :func:`encode_prompts`,
:func:`stop_token_ids` and :func:`pad_token_id`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from posttrain.generation.torch_compat import packed_linear_weights
from posttrain.generation.transformers_compat import new_cache, packed_decode_attention

logger = logging.getLogger(__name__)

__all__ = [
    "Completion",
    "EngineTool",
    "GenerationStats",
    "ToolCall",
    "draw_tokens",
    "encode_prompts",
    "generate_continuous",
    "pad_token_id",
    "stop_token_ids",
]


@dataclass(frozen=True)
class ToolCall:
    """What a tool made of the call(s) a completion ended with: the tokens to force (none when a call
    failed and the model continues on its own), how many calls, how many of them failed."""

    tokens: tuple[int, ...]
    failures: int = 0
    calls: int = 1

    @property
    def ok(self) -> bool:
        return self.failures == 0


class EngineTool(Protocol):
    """A tool the engine consults while a row decodes (see :mod:`posttrain.generation.tools`)."""

    name: str
    triggers: frozenset[int]
    """Token ids after which the tool is asked; any other token never calls it."""

    def __call__(self, token_ids: Sequence[int], request: int, prompt_ids: Sequence[int]) -> ToolCall | None:
        """The call the completion ``token_ids`` of prompt ``request`` (``prompt_ids``) ends with (None: no call).

        A stop token in ``triggers`` whose call returns tokens does not end the row: the tool's
        tokens follow it and the model continues (a chat template's tool turn)."""


@dataclass(frozen=True)
class Completion:
    """Generated token ids of one sequence; ``finished`` is False when it hit ``max_new_tokens``."""

    token_ids: tuple[int, ...]
    """Includes the stop token when one was generated (as ``generate`` returns it)."""
    finished: bool
    env_mask: tuple[int, ...] | None = None
    """With a tool: 1 for each token the model chose, 0 for each token a tool forced; None without one."""
    tool_calls: int = 0
    """Calls the completion made (failed ones included)."""
    tool_failures: int = 0
    """Calls whose input the tool could not use (malformed or unsafe); the model continued on its own."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def model_tokens(self) -> int:
        """Tokens the model chose (forced tokens excluded)."""
        return sum(self.env_mask) if self.env_mask is not None else len(self.token_ids)


@dataclass
class GenerationStats:
    """What one generation run cost; ``row_steps`` / ``decode_steps`` is the mean batch occupancy."""

    sequences: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    decode_steps: int = 0
    row_steps: int = 0
    prefills: int = 0
    tool_calls: int = 0
    tool_failures: int = 0
    forced_tokens: int = 0
    shared_prefix_tokens: int = 0
    """Prompt tokens a prefill did not compute because its prompts share them (see ``_prefill``)."""

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0

    def tool_metrics(self) -> dict[str, float]:
        """How often completions called a tool and how often a call failed, under TRL's metric names.

        >>> GenerationStats(sequences=4, tool_calls=6, tool_failures=3).tool_metrics()
        {'tools/call_frequency': 1.5, 'tools/failure_frequency': 0.5}
        """
        return {
            "tools/call_frequency": self.tool_calls / max(self.sequences, 1),
            "tools/failure_frequency": self.tool_failures / self.tool_calls if self.tool_calls else 0.0,
        }

    def as_dict(self) -> dict[str, float]:
        return {
            "sequences": self.sequences,
            "prompt_tokens": self.prompt_tokens,
            "generated_tokens": self.generated_tokens,
            "seconds": round(self.seconds, 3),
            "tokens_per_second": round(self.tokens_per_second, 2),
            "decode_steps": self.decode_steps,
            "mean_batch_rows": round(self.row_steps / self.decode_steps, 2) if self.decode_steps else 0.0,
            "prefills": self.prefills,
            "tool_calls": self.tool_calls,
            "tool_failures": self.tool_failures,
            "forced_tokens": self.forced_tokens,
            "shared_prefix_tokens": self.shared_prefix_tokens,
        }


def stop_token_ids(model: Any, tokenizer: Any) -> set[int]:
    """Token ids that end a completion: the generation config's EOS ids plus the tokenizer's EOS.

    Chat models often list several (e.g. ``<|im_end|>`` and ``<|endoftext|>``); the union makes the
    engine stop wherever ``generate`` would, and also when only the tokenizer knows the chat stop.
    """
    ids: set[int] = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos is not None:
        ids.update(int(i) for i in eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    if not ids:
        raise ValueError("the model and tokenizer define no EOS token: generation would never stop early")
    return ids


def pad_token_id(tokenizer: Any) -> int:
    """The id that fills padding columns: the tokenizer's pad token, else its EOS (the mask hides either)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer defines neither a pad nor an EOS token")
    return int(pad)


def encode_prompts(
    tokenizer: Any, conversations: Iterable[Sequence[dict[str, str]]], **template_kwargs: Any
) -> list[list[int]]:
    """Token ids of chat prompts ending with the assistant turn opener.

    The template is rendered to text first and tokenized without special tokens, because templates
    that write their own BOS would otherwise get a second one from the tokenizer (this is also what
    ``apply_chat_template(tokenize=True)`` does, which TRL's GRPO uses; a test checks they agree).
    ``template_kwargs`` reach the template (e.g. TRL's ``chat_template_kwargs``).
    """
    texts = [
        tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True, **template_kwargs
        )
        for messages in conversations
    ]
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


class _Batch:
    """The rows being decoded: KV cache, 2-D padding mask, next position and last token per row."""

    def __init__(
        self,
        cache: Any,
        mergeable: bool,
        mask: torch.Tensor,
        positions: torch.Tensor,
        last: torch.Tensor,
        requests: list[int],
    ) -> None:
        self.cache, self.mergeable, self.mask = cache, mergeable, mask
        self.positions, self.last, self.requests = positions, last, requests

    def __len__(self) -> int:
        return len(self.requests)

    def keep(self, rows: list[int]) -> None:
        """Drop every row not in ``rows``, then trim cache columns that no remaining row uses.

        A mergeable cache shifts only the rows after the first finished one, in place, and shrinks
        to a view: the rows before it are not copied.
        """
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        if self.mergeable:
            first = next((i for i, row in enumerate(rows) if row != i), len(rows))
            for layer in self.cache.layers:
                layer.compact(first, index[first:], len(rows))
        else:
            self.cache.batch_select_indices(index)
        self.mask, self.positions, self.last = self.mask[index], self.positions[index], self.last[index]
        self.requests = [self.requests[i] for i in rows]
        lead = int(self.mask.any(0).to(torch.int8).argmax()) if rows else 0
        if lead > 0 and self.mergeable:
            for layer in self.cache.layers:
                layer.drop_leading(lead)
            self.mask = self.mask[:, lead:]

    def absorb(self, other: _Batch) -> None:
        """Append ``other``'s rows, left-padding whichever cache is shorter (masked out)."""
        length = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.absorb(theirs)
        self.mask = torch.cat([_left_pad(self.mask, length), _left_pad(other.mask, length)])
        self.positions = torch.cat([self.positions, other.positions])
        self.last = torch.cat([self.last, other.last])
        self.requests += other.requests


def _left_pad(mask: torch.Tensor, length: int) -> torch.Tensor:
    return F.pad(mask, (length - mask.shape[1], 0))


class _Sampler:
    """Greedy argmax, or temperature sampling with one seeded generator per sequence."""

    def __init__(self, temperature: float, seeds: Sequence[int] | None, count: int) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if seeds is not None and len(seeds) != count:
            raise ValueError(f"got {len(seeds)} seeds for {count} prompts")
        self.temperature = temperature
        self.seeds = list(seeds) if seeds is not None else list(range(count))
        self.generators: dict[int, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, requests: list[int]) -> torch.Tensor:
        if self.temperature == 0:
            # In fp32 like generate (exact for bf16 logits, same tie rule), and faster than a bf16 argmax.
            return logits.float().argmax(-1)
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        uniforms = torch.cat([torch.rand(1, generator=self._generator(r)) for r in requests])
        return draw_tokens(probs, uniforms.to(probs.device))

    def _generator(self, request: int) -> torch.Generator:
        if request not in self.generators:
            self.generators[request] = torch.Generator().manual_seed(int(self.seeds[request]))
        return self.generators[request]


def draw_tokens(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` by inverse CDF: the first index whose cumulative mass exceeds its uniform.

    The same distribution as ``generate``'s ``torch.multinomial``, from one random number per row
    (drawn from the row's own generator, so a row's tokens do not depend on its batch): one cumsum
    and one search over the vocabulary, where an exponential race needs a random number per
    vocabulary entry and ``multinomial`` one generator for the whole batch.
    """
    cdf = probs.cumsum(-1)
    target = uniforms[:, None] * cdf[:, -1:]  # scaled: the float sum is not exactly 1
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(1)


SHARED_PREFIX_MIN = 32
"""Shortest common prompt prefix a prefill computes once (shorter ones are not worth the extra call)."""


def _shared_prefix(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the prefix all ``prompts`` share, leaving every prompt at least one token of its own."""
    first, shortest = prompts[0], min(len(p) for p in prompts)
    length = 0
    while length < shortest - 1 and all(p[length] == first[length] for p in prompts):
        length += 1
    return length


def _prefill(
    model: Any, prompts: Sequence[Sequence[int]], requests: list[int], pad_id: int
) -> tuple[_Batch, torch.Tensor, int]:
    """Run the prompts of ``requests`` together; return their batch, last logits and prompt tokens skipped.

    Identical prompts are run once and their KV rows copied: GRPO asks for ``num_generations``
    completions of each prompt, DPO sampling and pass@k for several, so most of a prefill would
    otherwise recompute the same keys and values. Distinct prompts that start with the same
    ``SHARED_PREFIX_MIN`` or more tokens (a system prompt and chat template: 69 of GSM8K's ~138 prompt
    tokens with posttrain's default prompt) have that prefix run once, its KV copied to every row,
    and only the rest run over the batch. A row is then laid out as [prefix, padding, own tokens]:
    the mask hides the padding and positions count real tokens, so each row sees what it would see alone.
    """
    device = model.device
    slot: dict[tuple[int, ...], int] = {}
    distinct: list[int] = []
    rows = []
    for request in requests:
        key = tuple(prompts[request])
        if key not in slot:
            slot[key] = len(distinct)
            distinct.append(request)
        rows.append(slot[key])
    cache, mergeable = new_cache(model)
    shared = _shared_prefix([prompts[r] for r in distinct]) if len(distinct) > 1 and mergeable else 0
    if shared < SHARED_PREFIX_MIN:
        shared = 0
    if shared:
        head = torch.tensor([prompts[distinct[0]][:shared]], dtype=torch.long, device=device)
        model(input_ids=head, cache=cache, use_cache=True, logits_to_keep=1)
        cache.batch_select_indices(torch.zeros(len(distinct), dtype=torch.long, device=device))
    length = max(len(prompts[r]) for r in distinct) - shared
    ids = torch.full((len(distinct), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(distinct), length), dtype=torch.long)
    for row, request in enumerate(distinct):
        prompt = prompts[request][shared:]
        ids[row, length - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, length - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = shared + (mask.cumsum(-1) - 1).clamp(min=0)
    mask = torch.cat([mask.new_ones((len(distinct), shared)), mask], dim=1)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    logits = out.logits[:, -1]
    if len(distinct) < len(requests):
        index = torch.tensor(rows, dtype=torch.long, device=device)
        cache.batch_select_indices(index)
        ids, mask, logits = ids[index], mask[index], logits[index]
    batch = _Batch(cache, mergeable, mask, mask.sum(-1), ids[:, -1], list(requests))
    return batch, logits, shared * (len(distinct) - 1)


def _decode_step(model: Any, batch: _Batch) -> torch.Tensor:
    """Feed every row its last token; return the next-token logits."""
    mask = torch.cat([batch.mask, batch.mask.new_ones((len(batch), 1))], dim=1)
    out = model(
        input_ids=batch.last[:, None],
        attention_mask=mask,
        position_ids=batch.positions[:, None],
        cache=batch.cache,
        use_cache=True,
        logits_to_keep=1,
    )
    batch.mask = mask
    batch.positions = batch.positions + 1
    return out.logits[:, -1]


@torch.inference_mode()
def generate_continuous(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Iterable[int],
    pad_token_id: int,
    batch_size: int = 32,
    temperature: float = 0.0,
    seeds: Sequence[int] | None = None,
    refill_at: float = 0.5,
    progress: bool = False,
    desc: str = "generating",
    tool: EngineTool | None = None,
) -> tuple[list[Completion], GenerationStats]:
    """Generate a completion for every prompt (token ids); results come back in prompt order.

    ``batch_size`` caps the rows decoded together; ``refill_at`` is the fraction of ``batch_size``
    at or below which waiting prompts are admitted (1.0 admits on every freed slot). ``seeds`` (one per
    prompt, default its index) only matter when ``temperature > 0``. ``tool`` may force tokens into
    rows (see the module docstring); forced tokens count towards ``max_new_tokens``.
    """
    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError("max_new_tokens and batch_size must be >= 1")
    if not 0 <= refill_at <= 1:
        raise ValueError(f"refill_at must be in [0, 1], got {refill_at}")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    stop = set(stop_ids)
    sampler = _Sampler(temperature, seeds, len(prompts))
    outputs: list[list[int]] = [[] for _ in prompts]
    done: list[bool] = [False] * len(prompts)
    calls = _ToolCalls(tool, len(prompts))
    stats = GenerationStats(sequences=len(prompts), prompt_tokens=sum(len(p) for p in prompts))
    waiting = deque(sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i)))
    threshold = min(int(refill_at * batch_size), batch_size - 1)
    batch: _Batch | None = None
    bar = _progress_bar(len(prompts), desc, progress)
    start = last_report = time.perf_counter()

    def emit(current: _Batch, logits: torch.Tensor) -> None:
        tokens = sampler(logits, current.requests)
        chosen = tokens.tolist()
        if calls.pending:
            chosen = calls.force(current.requests, chosen)
            tokens = torch.tensor(chosen, dtype=tokens.dtype, device=tokens.device)
        current.last = tokens
        survivors = []
        for row, (request, token) in enumerate(zip(current.requests, chosen, strict=True)):
            outputs[request].append(token)
            if calls.tool is not None:
                calls.after(request, token, outputs[request], prompts[request])
            stopped = token in stop and request not in calls.queued
            if stopped or len(outputs[request]) >= max_new_tokens:
                done[request] = stopped
                calls.queued.pop(request, None)
                bar.update(1)
            else:
                survivors.append(row)
        stats.generated_tokens += len(current)
        if len(survivors) < len(current):
            current.keep(survivors)

    # One unmasked query token (transformers_compat) and bf16 weights laid out once (torch_compat).
    with packed_decode_attention(model), packed_linear_weights(model):
        while waiting or batch is not None:
            active = len(batch) if batch is not None else 0
            if waiting and active <= threshold and (batch is None or batch.mergeable):
                newcomers = [waiting.popleft() for _ in range(min(batch_size - active, len(waiting)))]
                fresh, logits, skipped = _prefill(model, prompts, newcomers, pad_token_id)
                stats.prefills += 1
                stats.shared_prefix_tokens += skipped
                emit(fresh, logits)
                if len(fresh):
                    if batch is None:
                        batch = fresh
                    else:
                        batch.absorb(fresh)
            if batch is not None and len(batch):
                logits = _decode_step(model, batch)
                stats.decode_steps += 1
                stats.row_steps += len(batch)
                emit(batch, logits)
            if batch is not None and not len(batch):
                batch = None
            now = time.perf_counter()
            if progress and now - last_report > 0.5:
                bar.set_postfix_str(f"{stats.generated_tokens / (now - start):.0f} tok/s", refresh=False)
                last_report = now
    stats.seconds = time.perf_counter() - start
    bar.close()
    stats.tool_calls, stats.tool_failures = sum(calls.calls), sum(calls.failures)
    stats.forced_tokens = sum(mask.count(0) for mask in calls.masks)
    logger.debug("generation stats: %s", stats.as_dict())
    return calls.completions(outputs, done), stats


class _ToolCalls:
    """Per request: the tokens a tool still has to force, which tokens were forced, calls made."""

    def __init__(self, tool: EngineTool | None, count: int) -> None:
        self.tool = tool
        self.queued: dict[int, deque[int]] = {}
        self.masks: list[list[int]] = [[] for _ in range(count)] if tool is not None else []
        self.calls = [0] * count
        self.failures = [0] * count

    @property
    def pending(self) -> bool:
        return bool(self.queued)

    def force(self, requests: list[int], chosen: list[int]) -> list[int]:
        """``chosen`` with each row that has queued tokens taking its next one instead."""
        forced = list(chosen)
        for row, request in enumerate(requests):
            queue = self.queued.get(request)
            if queue:
                forced[row] = queue.popleft()
                if not queue:
                    del self.queued[request]
                self.masks[request].append(0)
        return forced

    def after(self, request: int, token: int, completion: list[int], prompt: Sequence[int]) -> None:
        """Record the token just appended; after a model-chosen trigger, ask the tool."""
        mask = self.masks[request]
        if len(mask) == len(completion):  # force() already marked it
            return
        mask.append(1)
        assert self.tool is not None
        if token not in self.tool.triggers:
            return
        call = self.tool(completion, request, prompt)
        if call is None:
            return
        self.calls[request] += call.calls
        self.failures[request] += call.failures
        if call.tokens:
            self.queued[request] = deque(call.tokens)

    def completions(self, outputs: list[list[int]], done: list[bool]) -> list[Completion]:
        if self.tool is None:
            return [Completion(tuple(o), d) for o, d in zip(outputs, done, strict=True)]
        return [
            Completion(tuple(o), d, tuple(m), c, f)
            for o, d, m, c, f in zip(outputs, done, self.masks, self.calls, self.failures, strict=True)
        ]


def _progress_bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="seq", disable=not enabled, dynamic_ncols=True)
