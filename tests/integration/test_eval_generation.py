"""The one generation engine: it must produce exactly what `model.generate` produces (greedy, fp32), and
DPO's sampler and GRPO's rollout must go through it (same tokens for the same seeds)."""

from __future__ import annotations

import pytest
import torch

from posttrain.generation.engine import encode_prompts, generate_continuous, stop_token_ids
from posttrain.generation.transformers_compat import SlotLayer

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


def test_greedy_matches_generate_on_prompts_of_varied_lengths(lively_model, tiny_tokenizer, prompts):
    """Only the model's own EOS stops it; every prompt length differs, and the outputs are not one token."""
    stop = stop_token_ids(lively_model, tiny_tokenizer)
    expected = _reference(lively_model, tiny_tokenizer, prompts, stop)
    assert len({len(p) for p in prompts}) >= 5  # rows carry different amounts of left padding
    assert all(len(set(ids)) >= MAX_NEW // 2 for ids in expected), "the model repeats tokens: test is blind"
    for batch_size in (len(prompts), 3):
        completions, _ = generate_continuous(
            lively_model,
            prompts,
            max_new_tokens=MAX_NEW,
            stop_ids=stop,
            pad_token_id=tiny_tokenizer.pad_token_id,
            batch_size=batch_size,
        )
        assert [list(c.token_ids) for c in completions] == expected


def test_cache_layers_are_slot_layers(lively_model):
    from posttrain.generation.transformers_compat import new_cache

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


@pytest.mark.parametrize("cache_kind", ["slots", "dynamic"])
def test_repeated_prompts_are_prefilled_once(
    lively_model, tiny_tokenizer, prompts, stops, reference, monkeypatch, cache_kind
):
    """A group of G copies of one prompt (GRPO, DPO sampling, pass@k) runs its prompt through the model
    once; every copy still gets exactly what `generate` gives it (greedy) or what its seed draws alone."""
    from transformers import DynamicCache

    import posttrain.generation.engine as engine

    if cache_kind == "dynamic":
        monkeypatch.setattr(engine, "new_cache", lambda model: (DynamicCache(config=model.config), False))
    groups = [prompts[1], prompts[3], prompts[0]]
    repeated = [p for p in groups for _ in range(3)]
    prefill_rows = []
    hook = lively_model.register_forward_pre_hook(
        lambda _module, _args, kwargs: (
            prefill_rows.append(kwargs["input_ids"].shape[0]) if kwargs["input_ids"].shape[1] > 1 else None
        ),
        with_kwargs=True,
    )
    try:
        greedy, _ = generate_continuous(
            lively_model,
            repeated,
            max_new_tokens=MAX_NEW,
            stop_ids=stops,
            pad_token_id=tiny_tokenizer.pad_token_id,
            batch_size=len(repeated),
        )
    finally:
        hook.remove()
    assert prefill_rows == [3]  # three distinct prompts, nine rows
    expected = [reference[i] for i in (1, 3, 0) for _ in range(3)]
    assert [list(c.token_ids) for c in greedy] == expected

    kwargs = dict(
        max_new_tokens=12, stop_ids=stops, pad_token_id=tiny_tokenizer.pad_token_id, temperature=1.0
    )
    seeds = list(range(200, 200 + len(repeated)))
    together, _ = generate_continuous(lively_model, repeated, batch_size=len(repeated), seeds=seeds, **kwargs)
    alone = [
        generate_continuous(lively_model, [p], batch_size=1, seeds=[s], **kwargs)[0][0]
        for p, s in zip(repeated, seeds, strict=True)
    ]
    assert together == alone
    assert len({c.token_ids for c in together[:3]}) > 1  # copies of one prompt draw different samples


def test_draw_tokens_samples_the_distribution():
    from posttrain.generation.engine import draw_tokens

    probs = torch.tensor([[0.0, 0.5, 0.2, 0.0, 0.3]]).repeat(20000, 1)
    uniforms = torch.rand(20000, generator=torch.Generator().manual_seed(0))
    counts = torch.bincount(draw_tokens(probs, uniforms), minlength=5).float() / 20000
    assert counts[0] == 0 and counts[3] == 0  # zero-probability tokens are never drawn
    assert torch.allclose(counts, probs[0], atol=0.015)
    edges = draw_tokens(probs[:2], torch.tensor([0.0, 1.0 - 2**-24]))
    assert edges.tolist() == [1, 4]  # the extremes land on the first and last tokens with mass


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

    import posttrain.generation.engine as engine

    monkeypatch.setattr(engine, "new_cache", lambda model: (DynamicCache(config=model.config), False))
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


def test_dpo_sampler_draws_from_the_engine(lively_model, tiny_tokenizer):
    """`sample_completions` is the engine with one seed per sample: same tokens, any batch size."""
    from posttrain.generation.sampling import sample_completions, sample_seeds

    chats = [[{"role": "user", "content": q}] for q in QUESTIONS[:3]]
    kwargs = dict(temperature=1.0, max_new_tokens=10, seed=3)
    samples = sample_completions(lively_model, tiny_tokenizer, chats, 2, batch_size=4, **kwargs)
    flat = [ids for ids in encode_prompts(tiny_tokenizer, chats) for _ in range(2)]
    expected, _ = generate_continuous(
        lively_model,
        flat,
        max_new_tokens=10,
        stop_ids=stop_token_ids(lively_model, tiny_tokenizer),
        pad_token_id=tiny_tokenizer.pad_token_id,
        temperature=1.0,
        seeds=sample_seeds(3, len(flat)),
    )
    assert [ids for group in samples.token_ids for ids in group] == [list(c.token_ids) for c in expected]
    assert samples.texts[1][0] == tiny_tokenizer.decode(samples.token_ids[1][0], skip_special_tokens=True)
    assert samples.token_ids[0][0] != samples.token_ids[0][1]  # two samples of one prompt differ
    narrow = sample_completions(lively_model, tiny_tokenizer, chats, 2, batch_size=1, **kwargs)
    assert narrow.token_ids == samples.token_ids
    unseeded = sample_completions(lively_model, tiny_tokenizer, chats, 2, temperature=1.0, max_new_tokens=10)
    assert (
        unseeded.token_ids
        == sample_completions(lively_model, tiny_tokenizer, chats, 2, **{**kwargs, "seed": 0}).token_ids
    )


def test_sample_seeds_are_distinct_across_runs_seeded_one_apart():
    from posttrain.generation.sampling import sample_seeds

    assert sample_seeds(0, 3) == [0, 1, 2]
    assert sample_seeds(2, 2) == [2_000_006, 2_000_007]
    assert not set(sample_seeds(0, 1_000_003)) & set(sample_seeds(1, 10))
    assert sample_seeds(5, 0) == []


def test_the_sampler_counts_its_tokens_logs_one_line_and_shows_a_progress_bar(
    lively_model, tiny_tokenizer, caplog, capsys
):
    import re

    from posttrain.generation.sampling import Samples, sample_completions

    chats = [[{"role": "user", "content": q}] for q in QUESTIONS[:2]]
    with caplog.at_level("INFO", logger="posttrain.generation.sampling"):
        samples = sample_completions(
            lively_model, tiny_tokenizer, chats, 3, temperature=1.0, max_new_tokens=5, seed=1
        )
    assert [len(group) for group in samples.texts] == [3, 3]
    assert samples.generated_tokens == sum(len(ids) for group in samples.token_ids for ids in group) > 6
    assert samples.stats.sequences == 6 and samples.seconds == samples.stats.seconds
    (message,) = [r.getMessage() for r in caplog.records]
    assert re.fullmatch(
        rf"sampled 2 x 3 completions \({samples.generated_tokens} tokens\) in \d+\.\d s \(\d+ tok/s\)",
        message,
    )
    assert re.search(r"(^|\r)sampling: 100%.*6/6", capsys.readouterr().err, re.MULTILINE)
    assert samples.tool_metrics() == {"tools/call_frequency": 0.0, "tools/failure_frequency": 0.0}
    assert Samples([["a"]], [[[1, 2]]], 0.1).tool_metrics() == {}  # no statistics: no tool metrics
    assert Samples([["a"]], [[[1, 2]]], 0.1).generated_tokens == 2


def test_the_sampler_stops_at_every_stop_token_of_the_models_generation_config(
    lively_model, tiny_tokenizer, stops
):
    """Stop tokens come from the model's generation config, not only from the tokenizer's EOS."""
    from posttrain.generation.sampling import sample_completions

    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    stopping = _with_extra_eos(lively_model, stops)
    samples = sample_completions(stopping, tiny_tokenizer, chats, 2, temperature=1.0, max_new_tokens=MAX_NEW)
    flat = [ids for group in samples.token_ids for ids in group]
    assert all(len(ids) == MAX_NEW or ids[-1] in stops for ids in flat)
    assert any(len(ids) < MAX_NEW and ids[-1] != tiny_tokenizer.eos_token_id for ids in flat)


def _with_extra_eos(model, stops):
    """A copy of ``model`` whose generation config lists ``stops`` as EOS ids (completions end early)."""
    import copy

    stopping = copy.deepcopy(model)
    stopping.generation_config.eos_token_id = sorted(stops)
    return stopping


def _fake_trainer(model, tokenizer, temperature, step=0):
    """The parts of a GRPOTrainer that TRL's `rollout_func` contract hands over and ShadowRollout reads."""
    from types import SimpleNamespace

    args = SimpleNamespace(temperature=temperature, max_completion_length=MAX_NEW, chat_template_kwargs=None)
    return SimpleNamespace(
        args=args,
        processing_class=tokenizer,
        model=model,
        accelerator=SimpleNamespace(unwrap_model=lambda m: m),
        state=SimpleNamespace(global_step=step),
    )


def test_grpo_rollout_samples_from_the_engine(lively_model, tiny_tokenizer, stops):
    """The rollout returns TRL's keys, prompts tokenized by `encode_prompts`, and the engine's samples."""
    from posttrain.generation.rollout import ROLLOUT_KEYS, ShadowRollout

    policy = _with_extra_eos(lively_model, stops)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS[:3] for _ in range(2)]  # 2 generations each
    torch.manual_seed(11)
    out = ShadowRollout(torch.float32)(chats, _fake_trainer(policy, tiny_tokenizer, temperature=1.0))
    assert set(out) == set(ROLLOUT_KEYS) and out["logprobs"] is None
    assert out["prompt_ids"] == encode_prompts(tiny_tokenizer, chats)
    torch.manual_seed(11)
    seeds = torch.randint(0, 2**62, (len(chats),)).tolist()
    expected, _ = generate_continuous(
        policy,
        out["prompt_ids"],
        max_new_tokens=MAX_NEW,
        stop_ids=stops,
        pad_token_id=tiny_tokenizer.pad_token_id,
        temperature=1.0,
        seeds=seeds,
    )
    assert out["completion_ids"] == [list(c.token_ids) for c in expected]


def test_grpo_rollout_cuts_completions_after_eos_as_trl_does(lively_model, tiny_tokenizer, stops, prompts):
    """Near-zero temperature: `generate`'s greedy tokens, cut after the first EOS (kept), TRL's rule."""
    from posttrain.generation.rollout import ShadowRollout

    policy = _with_extra_eos(lively_model, stops)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    out = ShadowRollout(torch.float32)(chats, _fake_trainer(policy, tiny_tokenizer, temperature=1e-6))
    # TRL's `generate` runs past the extra stop ids (they are not the model's EOS); then TRL cuts.
    generated = _reference(
        lively_model, tiny_tokenizer, prompts, stop_token_ids(lively_model, tiny_tokenizer)
    )
    trl_cut = [next((ids[: i + 1] for i, t in enumerate(ids) if t in stops), ids) for ids in generated]
    assert out["completion_ids"] == trl_cut
    assert any(len(ids) < MAX_NEW for ids in trl_cut) and any(len(ids) == MAX_NEW for ids in trl_cut)


def test_bf16_engine_with_packed_linears_gives_the_unpacked_tokens(
    lively_model, tiny_tokenizer, prompts, stops, monkeypatch
):
    """bf16 decoding through prepacked linear weights (torch_compat) changes no token."""
    import contextlib
    import copy

    from posttrain.generation import engine, torch_compat

    if not torch_compat.bf16_prepack_supported():
        pytest.skip("this CPU has no native bf16 in oneDNN: the engine leaves linears unpacked here")
    model = copy.deepcopy(lively_model).to(torch.bfloat16)
    run = dict(max_new_tokens=MAX_NEW, stop_ids=stops, pad_token_id=tiny_tokenizer.pad_token_id, batch_size=4)
    packed, _ = generate_continuous(model, prompts, **run)
    monkeypatch.setattr(engine, "packed_linear_weights", lambda model: contextlib.nullcontext(0))
    plain, _ = generate_continuous(model, prompts, **run)
    assert [c.token_ids for c in packed] == [c.token_ids for c in plain]
    assert len({len(c.token_ids) for c in plain}) > 1  # the comparison covers rows finishing early


def test_a_finished_row_moves_only_the_rows_after_it():
    """Dropping rows shifts the later rows up in place: earlier rows are neither copied nor reallocated."""
    layer = SlotLayer()
    keys = torch.arange(5.0)[:, None, None, None].expand(5, 2, 3, 4).contiguous()
    layer.update(keys, keys + 100)
    buffer = layer._k.data_ptr()
    first_row = layer._k[0].clone()
    layer.compact(1, torch.tensor([2, 4]), 3)  # rows 1 and 3 finished: keep 0, 2, 4
    assert layer._k.data_ptr() == buffer  # a view of the same storage, no new allocation
    assert layer.keys[:, 0, 0, 0].tolist() == [0.0, 2.0, 4.0]
    assert layer.values[:, 0, 0, 0].tolist() == [100.0, 102.0, 104.0]
    assert torch.equal(layer._k[0], first_row)
    assert layer.get_seq_length() == 3 and layer.keys.shape == (3, 2, 3, 4)


SYSTEM = "You are a careful math tutor. Think step by step, check every calculation, then answer."


@pytest.mark.parametrize(("batch_size", "refill_at"), [(7, 0.5), (3, 0.5), (3, 1.0)])
def test_shared_system_prompt_is_prefilled_once_and_changes_no_token(
    lively_model, tiny_tokenizer, stops, batch_size, refill_at
):
    """Prompts that start alike have that prefix run once; greedy tokens still equal ``generate``'s."""
    from posttrain.generation.engine import SHARED_PREFIX_MIN, _shared_prefix

    conversations = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS
    ]
    shared_prompts = encode_prompts(tiny_tokenizer, conversations)
    assert _shared_prefix(shared_prompts) >= SHARED_PREFIX_MIN  # the test exercises the shared path
    expected = _reference(lively_model, tiny_tokenizer, shared_prompts, stops)
    completions, stats = generate_continuous(
        lively_model,
        shared_prompts,
        max_new_tokens=MAX_NEW,
        stop_ids=stops,
        pad_token_id=tiny_tokenizer.pad_token_id,
        batch_size=batch_size,
        refill_at=refill_at,
    )
    assert [list(c.token_ids) for c in completions] == expected
    assert stats.shared_prefix_tokens >= _shared_prefix(shared_prompts) * (batch_size - 1)


def test_shared_prefix_leaves_every_prompt_a_token_of_its_own():
    from posttrain.generation.engine import _shared_prefix

    assert _shared_prefix([[1, 2, 3, 4], [1, 2, 3, 9], [1, 2, 3, 4, 5]]) == 3
    assert _shared_prefix([[1, 2, 3], [1, 2, 3, 4]]) == 2  # the shorter one keeps its last token
    assert _shared_prefix([[7, 2], [1, 2]]) == 0
