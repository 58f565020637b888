"""Tools inside the one engine: the calculator forces exactly its value's tokens, marks them in
``env_mask``, counts calls (failed ones too), and leaves rows that never call it untouched."""

from __future__ import annotations

import pytest
import torch

from posttrain.generation.engine import ToolCall, encode_prompts, generate_continuous, stop_token_ids
from posttrain.generation.tools import Calculator, engine_tool


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def bigram_model(tokenizer, successors: dict[int, int], default: int):
    """A one-layer Llama whose greedy next token depends only on the current token (``successors``,
    else ``default``): a scripted writer, so a test can make one row write ``12*7 =`` and another
    never write ``=``. The attention still runs (small random output), so rows share a real cache."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    vocab = len(tokenizer)
    width = ((vocab + 7) // 8) * 8
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=width,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=8,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        model.model.layers[0].self_attn.o_proj.weight.mul_(0.01)
        model.model.layers[0].mlp.down_proj.weight.zero_()
        head = model.lm_head.weight
        head.zero_()
        for token in range(vocab):
            head[successors.get(token, default), token] = 1.0
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return model


def chain(tokenizer, *texts: str) -> dict[int, int]:
    """Successors that make the model write each text's tokens in order, then EOS."""
    successors: dict[int, int] = {}
    for text in texts:
        ids = _ids(tokenizer, text) + [tokenizer.eos_token_id]
        for current, following in zip(ids, ids[1:], strict=False):
            assert successors.get(current, following) == following, f"{text!r} needs a second successor"
            successors[current] = following
    return successors


def _run(model, tokenizer, prompts, tool, max_new=20):
    return generate_continuous(
        model,
        prompts,
        max_new_tokens=max_new,
        stop_ids=stop_token_ids(model, tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        batch_size=4,
        tool=tool,
    )


@pytest.fixture(scope="module")
def scripted(tiny_tokenizer):
    """Row 0's prompt ends in 'Q' and it writes '12*7 =' then '9' (wrong); after the calculator's ' 84'
    it writes '.'; row 1's prompt ends in 'z' and it writes 'abc' and stops, never calling."""
    t = tiny_tokenizer
    successors = chain(t, "Q12*7 =9", "zabc", "4.")
    model = bigram_model(t, successors, default=t.eos_token_id)
    prompts = [_ids(t, "hello Q"), _ids(t, "hi z"), _ids(t, "long prompt for row two z")]
    return model, prompts


def test_calculator_forces_exactly_its_value_and_other_rows_stay_identical(scripted, tiny_tokenizer):
    t = tiny_tokenizer
    model, prompts = scripted
    bare, bare_stats = _run(model, t, prompts, tool=None)
    assert t.decode(bare[0].token_ids, skip_special_tokens=True) == "12*7 =9"  # the model's own slip
    with_tool, stats = _run(model, t, prompts, tool=Calculator(t))
    first = with_tool[0]
    assert t.decode(first.token_ids, skip_special_tokens=True) == "12*7 = 84."
    forced = _ids(t, " 84")
    written = _ids(t, "12*7 =")
    assert list(first.token_ids) == written + forced + _ids(t, ".") + [t.eos_token_id]
    assert first.env_mask == tuple([1] * len(written) + [0] * len(forced) + [1, 1])
    assert (first.tool_calls, first.tool_failures, first.model_tokens) == (1, 0, len(written) + 2)
    for row in (1, 2):  # never called: same tokens as without the tool, all marked as the model's
        assert with_tool[row].token_ids == bare[row].token_ids
        assert with_tool[row].env_mask == (1,) * bare[row].num_tokens
        assert with_tool[row].tool_calls == 0
    assert bare[0].env_mask is None and bare_stats.tool_calls == 0
    assert (stats.tool_calls, stats.tool_failures, stats.forced_tokens) == (1, 0, len(forced))
    # one decode step per forced token: the longest row's length, less the prefill's token
    assert stats.decode_steps == max(c.num_tokens for c in with_tool) - 1


def test_a_call_the_calculator_cannot_compute_is_left_to_the_model_and_counted(tiny_tokenizer):
    t = tiny_tokenizer
    model = bigram_model(t, chain(t, "Q1/0 =9"), default=t.eos_token_id)
    prompts = [_ids(t, "Q")]
    bare, _ = _run(model, t, prompts, tool=None)
    with_tool, stats = _run(model, t, prompts, tool=Calculator(t))
    assert with_tool[0].token_ids == bare[0].token_ids  # nothing forced
    assert (with_tool[0].tool_calls, with_tool[0].tool_failures) == (1, 1)
    assert set(with_tool[0].env_mask) == {1}
    assert (stats.tool_calls, stats.tool_failures, stats.forced_tokens) == (1, 1, 0)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12*7 =", (" 84", True)),  # the trained form
        ("He paid $72 + $23 = ", ("95", True)),  # spaced after '=': no second space
        ("<<3*4=", ("12>>", True)),  # GSM8K's annotation closes itself
        ("2**99 =", ("", False)),  # a power: refused
        ("__import__ =", ("", False)),  # a name: refused
        ("1/0 =", ("", False)),  # division by zero: refused
        ("The total =", None),  # words only: no call
        ("7 ==", None),  # a comparison, not a calculation
    ],
)
def test_calculator_tool_on_token_ids(tiny_tokenizer, text, expected):
    call = Calculator(tiny_tokenizer)(_ids(tiny_tokenizer, text))
    if expected is None:
        assert call is None
    else:
        insert, ok = expected
        assert call == ToolCall(tuple(_ids(tiny_tokenizer, insert)) if insert else (), ok)


def test_calculator_triggers_are_the_tokens_ending_in_equals(tiny_tokenizer):
    triggers = Calculator(tiny_tokenizer).triggers
    texts = {tiny_tokenizer.decode([i]) for i in triggers}
    assert "=" in texts
    assert all(text.rstrip().endswith("=") for text in texts)


def test_engine_tool_names(tiny_tokenizer):
    assert engine_tool([], tiny_tokenizer) is None
    assert isinstance(engine_tool(["calculator"], tiny_tokenizer), Calculator)
    with pytest.raises(ValueError, match="unknown engine tool"):
        engine_tool(["python"], tiny_tokenizer)


class ForceAfter:
    """A test tool: after ``trigger`` (a token the model really writes), force ``tokens``."""

    name = "force-after"

    def __init__(self, trigger: int, tokens: tuple[int, ...]):
        self.triggers = frozenset({trigger})
        self.tokens = tokens

    def __call__(self, token_ids):
        return ToolCall(self.tokens, True)


def test_after_forced_tokens_rows_continue_as_generate_does_on_the_same_prefix(
    tiny_model_dir, tiny_tokenizer
):
    """fp32 greedy with real attention: each completion equals `generate` continuing from the prompt
    plus everything before its last forced token, so forcing leaves every row's cache exact."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    t = tiny_tokenizer
    questions = ["What is 2+2?", "x", "A baker makes 3 trays of 24 cookies each day.", "hi there", "7 8 9"]
    prompts = encode_prompts(t, [[{"role": "user", "content": q}] for q in questions])
    stop = {t.eos_token_id}
    plain, _ = generate_continuous(
        model, prompts, max_new_tokens=16, stop_ids=stop, pad_token_id=t.pad_token_id, batch_size=3
    )
    counts: dict[int, int] = {}
    for completion in plain:
        for token in set(completion.token_ids[1:6]):
            counts[token] = counts.get(token, 0) + 1
    trigger = max(counts, key=lambda k: (counts[k] if counts[k] < len(prompts) else 0, -k))
    tool = ForceAfter(trigger, tuple(_ids(t, " 84")))
    forced, stats = generate_continuous(
        model, prompts, max_new_tokens=16, stop_ids=stop, pad_token_id=t.pad_token_id, batch_size=3, tool=tool
    )
    assert stats.tool_calls >= 2
    called = 0
    for prompt, before, after in zip(prompts, plain, forced, strict=True):
        if not after.tool_calls:
            assert after.token_ids == before.token_ids
            continue
        called += 1
        last_forced = max(i for i, m in enumerate(after.env_mask) if m == 0)
        prefix = list(prompt) + list(after.token_ids[: last_forced + 1])
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prefix]),
                max_new_tokens=16 - last_forced - 1,
                do_sample=False,
                eos_token_id=t.eos_token_id,
                pad_token_id=t.pad_token_id,
            )
        assert list(after.token_ids[last_forced + 1 :]) == out[0, len(prefix) :].tolist()
    assert called >= 2


def test_grpo_masks_the_calculators_tokens_out_of_the_loss(tiny_tokenizer, tmp_path):
    """Rollouts return ``env_mask``; TRL turns it into its tool mask, and the loss's gradient reaches
    exactly the positions that predict model tokens (none that predict the calculator's)."""
    from posttrain.core.config import DataConfig, GRPOStageConfig, ModelConfig, SyntheticConfig
    from posttrain.data.prepare import prepare_data
    from posttrain.training.grpo import make_grpo_trainer
    from posttrain.training.runner import StageContext

    t = tiny_tokenizer
    model_dir = tmp_path / "scripted"
    bigram_model(t, chain(t, "\n12*7 =9", "4."), default=t.eos_token_id).save_pretrained(model_dir)
    t.save_pretrained(model_dir)
    data = prepare_data(
        DataConfig(source="synthetic", synthetic=SyntheticConfig(num_examples=8), eval_size=2), t
    ).train
    stage = GRPOStageConfig(
        name="calc",
        rewards=[{"name": "xml_count"}],
        tools=["calculator"],
        trainer={
            "max_steps": 1,
            "per_device_train_batch_size": 2,
            "num_generations": 2,
            "max_completion_length": 12,
        },
    )
    ctx = StageContext(
        stage="grpo-calc", work_dir=tmp_path / "work", seed=0, report_to="none", precision="fp32"
    )
    trainer, _ = make_grpo_trainer(
        stage, ModelConfig(name=str(model_dir), precision="fp32"), str(model_dir), data, ctx
    )
    batch = trainer._generate_and_score_completions([dict(data[0]), dict(data[0])])
    written, forced = _ids(t, "12*7 ="), _ids(t, " 84")
    expected = written + forced + _ids(t, ".") + [t.eos_token_id]
    assert batch["completion_ids"][0].tolist()[: len(expected)] == expected
    mask = [1] * len(written) + [0] * len(forced) + [1, 1]
    assert batch["tool_mask"][0].tolist()[: len(mask)] == mask
    assert trainer._metrics["train"]["tools/call_frequency"] == [1.0]

    captured = {}

    def keep_hidden(_module, _inputs, hidden):
        hidden.retain_grad()
        captured["hidden"] = hidden

    handle = trainer.model.model.norm.register_forward_hook(keep_hidden)
    batch["advantages"] = torch.ones_like(batch["advantages"])
    try:
        trainer.compute_loss(trainer.model, batch).backward()
    finally:
        handle.remove()
    prompt_len = batch["prompt_ids"].shape[1]
    # position prompt_len + i - 1 predicts completion token i
    grads = captured["hidden"].grad[0, prompt_len - 1 : prompt_len - 1 + len(mask)].abs().sum(-1)
    for i, keep in enumerate(mask):
        assert (grads[i] > 0) == bool(keep), f"completion token {i} ({'model' if keep else 'tool'})"
