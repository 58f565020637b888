"""The continuous-batching engine must produce exactly what `model.generate` produces (greedy, fp32)."""

from __future__ import annotations

import pytest
import torch

from posttrain.generation.engine import encode_prompts, generate_continuous, stop_token_ids
from posttrain.generation.kv_cache import SlotLayer

QUESTIONS = [
    "What is 2+2?",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many?",
    "x",
    "A baker makes 3 trays of 24 cookies each day. Each box holds 6 cookies. How many boxes per week? "
    "Tom drives 60 miles per hour.",
    "How many clips did Natalia sell altogether",
    "hi there",
    "7 8 9",
]
MAX_NEW = 24


@pytest.fixture(scope="module")
def lively_model(tiny_model_dir):
    """The tiny model with larger random weights: its greedy outputs vary instead of repeating one token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    return model


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    return encode_prompts(tiny_tokenizer, [[{"role": "user", "content": q}] for q in QUESTIONS])


@pytest.fixture(scope="module")
def stops(lively_model, tiny_tokenizer, prompts):
    """EOS plus two tokens the model emits mid-sequence, so completions stop at different lengths."""
    base = stop_token_ids(lively_model, tiny_tokenizer)
    first = _reference(lively_model, tiny_tokenizer, prompts, base)
    counts: dict[int, int] = {}
    for ids in first:
        for token in ids[2:]:
            counts[token] = counts.get(token, 0) + 1
    frequent = sorted(counts, key=lambda t: (-counts[t], t))[:2]
    return base | set(frequent)


def _reference(model, tokenizer, prompts, stop, max_new=MAX_NEW):
    """One greedy `generate` call per prompt: the ground truth, free of any padding."""
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new,
                do_sample=False,
                eos_token_id=sorted(stop),
                pad_token_id=tokenizer.pad_token_id,
            )
            out.append(ids[0, len(prompt) :].tolist())
    return out


@pytest.fixture(scope="module")
def reference(lively_model, tiny_tokenizer, prompts, stops):
    ref = _reference(lively_model, tiny_tokenizer, prompts, stops)
    lengths = {len(r) for r in ref}
    assert len(lengths) >= 3 and MAX_NEW in lengths, f"test needs varied lengths, got {lengths}"
    return ref


@pytest.mark.parametrize(
    ("batch_size", "refill_at"),
    [
        (7, 0.5),  # all prompts in one batch; finished rows leave
        (1, 0.0),  # one at a time
        (2, 0.0),  # refill only when the batch empties
        (3, 0.5),  # waves: refill when a third of the rows is left
        (3, 1.0),  # refill on every freed slot: constant cache merging
        (4, 0.75),
    ],
)
def test_greedy_matches_generate_token_for_token(
    lively_model, tiny_tokenizer, prompts, stops, reference, batch_size, refill_at
):
    completions, stats = generate_continuous(
        lively_model,
        prompts,
        max_new_tokens=MAX_NEW,
        stop_ids=stops,
        pad_token_id=tiny_tokenizer.pad_token_id,
        batch_size=batch_size,
        refill_at=refill_at,
    )
    assert [list(c.token_ids) for c in completions] == reference
    assert [c.finished for c in completions] == [r[-1] in stops for r in reference]
    assert stats.generated_tokens == sum(map(len, reference))
    assert stats.row_steps / stats.decode_steps <= batch_size
    if batch_size < len(prompts):
        assert stats.prefills > 1  # slots were refilled


def test_finished_rows_cost_no_decode_steps(lively_model, tiny_tokenizer, prompts, stops, reference):
    """Each decode step feeds one token per still-running row: no row is decoded after its stop token."""
    _, stats = generate_continuous(
        lively_model,
        prompts,
        max_new_tokens=MAX_NEW,
        stop_ids=stops,
        pad_token_id=tiny_tokenizer.pad_token_id,
        batch_size=len(prompts),
    )
    # Prefill yields each row's first token; every later token costs exactly one row-step.
    assert stats.row_steps == sum(len(r) - 1 for r in reference)


def test_cache_layers_are_slot_layers(lively_model):
    from posttrain.generation.kv_cache import new_cache

    cache, mergeable = new_cache(lively_model)
    assert mergeable and all(isinstance(layer, SlotLayer) for layer in cache.layers)


def test_sampling_is_seeded_per_sequence(lively_model, tiny_tokenizer, prompts, stops):
    """A sequence's sample depends on its seed, not on the batch it shared or the order of prompts."""
    kwargs = dict(
        max_new_tokens=12, stop_ids=stops, pad_token_id=tiny_tokenizer.pad_token_id, temperature=1.0
    )
    seeds = list(range(100, 100 + len(prompts)))
    wide, _ = generate_continuous(lively_model, prompts, batch_size=7, seeds=seeds, **kwargs)
    narrow, _ = generate_continuous(lively_model, prompts, batch_size=2, seeds=seeds, **kwargs)
    assert wide == narrow
    other, _ = generate_continuous(
        lively_model, prompts, batch_size=7, seeds=[s + 1 for s in seeds], **kwargs
    )
    assert other != wide


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"refill_at": 1.5}, "refill_at"),
        ({"temperature": -1.0}, "temperature"),
        ({"seeds": [1]}, "seeds"),
    ],
)
def test_bad_arguments_are_rejected(lively_model, prompts, kwargs, message):
    args = {"max_new_tokens": 4, "stop_ids": {0}, "pad_token_id": 0, **kwargs}
    with pytest.raises(ValueError, match=message):
        generate_continuous(lively_model, prompts, **args)


def test_models_without_mergeable_caches_fall_back_to_waves(
    lively_model, tiny_tokenizer, prompts, stops, reference, monkeypatch
):
    """Caches the engine cannot pad (sliding windows...) refill only once the batch is empty, still exactly."""
    from transformers import DynamicCache

    import posttrain.generation.engine as generation

    monkeypatch.setattr(generation, "new_cache", lambda model: (DynamicCache(config=model.config), False))
    completions, stats = generate_continuous(
        lively_model,
        prompts,
        max_new_tokens=MAX_NEW,
        stop_ids=stops,
        pad_token_id=tiny_tokenizer.pad_token_id,
        batch_size=3,
        refill_at=1.0,
    )
    assert [list(c.token_ids) for c in completions] == reference
    assert stats.prefills == 3  # 3 + 3 + 1 prompts, each wave admitted into an empty batch
