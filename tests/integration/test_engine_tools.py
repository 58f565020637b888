"""Tools inside the one engine: the calculator forces exactly its value's tokens, marks them in
``env_mask``, counts calls (failed ones too), and leaves rows that never call it untouched."""

from __future__ import annotations

import pytest
import torch
from scripted_models import bigram_model, chain
from scripted_models import token_ids as _ids

from posttrain.generation.engine import ToolCall, encode_prompts, generate_continuous, stop_token_ids
from posttrain.generation.tools import Calculator, engine_tool


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


def test_dpo_samples_run_the_calculator_named_in_tools(tiny_tokenizer):
    """The DPO sampler hands its ``tools`` to the engine: the model's own slip is corrected and the
    call counted, as in evaluation and GRPO."""
    from posttrain.generation.sampling import sample_completions

    t = tiny_tokenizer
    chats = [[{"role": "user", "content": "hi"}]]
    (last,) = encode_prompts(t, chats)[0][-1:]  # the template's last token: the model starts there
    model = bigram_model(t, chain(t, t.decode([last]) + "12*7 =9", "4."), default=t.eos_token_id)
    kwargs = dict(temperature=1e-3, max_new_tokens=20)  # near-greedy: the scripted path
    bare = sample_completions(model, t, chats, 2, **kwargs)
    assert bare.texts == [["12*7 =9", "12*7 =9"]] and bare.tool_metrics()["tools/call_frequency"] == 0
    tooled = sample_completions(model, t, chats, 2, tools=("calculator",), **kwargs)
    assert tooled.texts == [["12*7 = 84.", "12*7 = 84."]]
    assert tooled.tool_metrics() == {"tools/call_frequency": 1.0, "tools/failure_frequency": 0.0}
    # A generation config that names another stop token: the tokenizer's EOS still ends the sample.
    model.generation_config.eos_token_id = _ids(t, "Q")
    (ids,) = sample_completions(model, t, chats, 1, **kwargs).token_ids[0]
    assert ids == _ids(t, "12*7 =9") + [t.eos_token_id]


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
        assert call == ToolCall(
            tuple(_ids(tiny_tokenizer, insert)) if insert else (), failures=0 if ok else 1
        )


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

    def __call__(self, token_ids, request, prompt_ids):
        return ToolCall(self.tokens)


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
    from posttrain.training.stage_run import StageContext

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


# --------------------------------------------------------------------------- TRL's chat tool protocol


@pytest.fixture(scope="module")
def tool_template_tokenizer(tiny_model_dir):
    """The tiny tokenizer with Qwen2.5's chat template (TRL's copy) and its tool-call tokens."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.chat_template = qwen2_5_chat_template
    return tokenizer


def _tool_turn(tokenizer, expression):
    text = (
        f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}\n</tool_call>'
    )
    return _ids(tokenizer, text) + [tokenizer.eos_token_id]


def test_chat_tool_loop_renders_tool_turns_exactly_as_trl_does(tool_template_tokenizer):
    from types import SimpleNamespace

    from trl import GRPOTrainer

    from posttrain.core.calculator import calculator
    from posttrain.generation.tools import ChatToolLoop

    t = tool_template_tokenizer
    prompt = t.apply_chat_template(
        [{"role": "user", "content": "12 times 7?"}],
        tools=[calculator],
        add_generation_prompt=True,
        return_dict=False,
    )
    loop = ChatToolLoop(t, [t.eos_token_id], [calculator])
    trl_self = SimpleNamespace(
        processing_class=t, _tokenizer=t, chat_template=None, chat_template_kwargs={}, _is_vlm=False
    )
    first = _tool_turn(t, "12*7")
    call = loop(first, 0, prompt)
    messages = [{"role": "tool", "name": "calculator", "content": "84"}]
    assert list(call.tokens) == GRPOTrainer._get_tool_suffix_ids(trl_self, messages)
    assert (call.calls, call.failures) == (1, 0)
    # the next turn is parsed on its own: a failing call is answered with TRL's error message
    second = [*first, *call.tokens, *_tool_turn(t, "2**9")]
    failed = loop(second, 0, prompt)
    assert (failed.calls, failed.failures) == (1, 1)
    assert "error" in t.decode(failed.tokens) and "2**9" in t.decode(failed.tokens)
    assert loop([*second, *failed.tokens, *_ids(t, "It is 84."), t.eos_token_id], 0, prompt) is None


def test_chat_tool_loop_refuses_a_template_without_tool_calls(tiny_tokenizer):
    from posttrain.core.calculator import calculator
    from posttrain.core.errors import ModelError
    from posttrain.generation.tools import ChatToolLoop

    with pytest.raises(ModelError, match="cannot render tool calls"):
        ChatToolLoop(tiny_tokenizer, [tiny_tokenizer.eos_token_id], [calculator])


class AnswerOnceAtStop:
    """A test tool: the first time a row stops, force ``tokens`` after the stop token (a tool turn)."""

    name = "answer-once"

    def __init__(self, stop: int, tokens: tuple[int, ...]):
        self.triggers = frozenset({stop})
        self.tokens, self.answered = tokens, set()

    def __call__(self, token_ids, request, prompt_ids):
        if request in self.answered:
            return None
        self.answered.add(request)
        return ToolCall(self.tokens)


def test_a_row_the_tool_answers_at_its_stop_token_goes_on_generating(tiny_model_dir, tiny_tokenizer):
    """fp32 greedy: after the stop token and the forced turn, the row continues exactly as `generate`
    does from that prefix, and ends at its next stop token."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    t = tiny_tokenizer
    prompts = encode_prompts(t, [[{"role": "user", "content": q}] for q in ("What is 2+2?", "x", "hi there")])
    counts: dict[int, int] = {}
    plain, _ = generate_continuous(
        model, prompts, max_new_tokens=12, stop_ids={t.eos_token_id}, pad_token_id=t.pad_token_id
    )
    for completion in plain:
        for token in completion.token_ids[1:4]:
            counts[token] = counts.get(token, 0) + 1
    stop = max(counts, key=lambda k: (counts[k], -k))  # a token every row writes early: the "stop"
    tool = AnswerOnceAtStop(stop, tuple(_ids(t, "\nresult 84\n")))
    out, stats = generate_continuous(
        model,
        prompts,
        max_new_tokens=40,
        stop_ids={stop},
        pad_token_id=t.pad_token_id,
        batch_size=2,
        tool=tool,
    )
    assert stats.tool_calls >= 1
    for prompt, completion in zip(prompts, out, strict=True):
        if not completion.tool_calls:
            continue
        first_stop = completion.token_ids.index(stop)
        forced = len(tool.tokens)
        assert completion.env_mask[first_stop] == 1 and set(
            completion.env_mask[first_stop + 1 : first_stop + 1 + forced]
        ) == {0}
        prefix = list(prompt) + list(completion.token_ids[: first_stop + 1 + forced])
        with torch.inference_mode():
            expected = model.generate(
                torch.tensor([prefix]),
                max_new_tokens=40 - first_stop - 1 - forced,
                do_sample=False,
                eos_token_id=stop,
                pad_token_id=t.pad_token_id,
            )[0, len(prefix) :].tolist()
        assert list(completion.token_ids[first_stop + 1 + forced :]) == expected
        assert completion.finished == (expected[-1] == stop)


def test_chat_tools_reach_trls_trainer(tool_template_tokenizer, tmp_path):
    from posttrain.core.calculator import calculator
    from posttrain.core.config import DataConfig, GRPOStageConfig, ModelConfig, SyntheticConfig
    from posttrain.data.prepare import prepare_data
    from posttrain.models.tiny import build_tiny_model
    from posttrain.training.grpo import make_grpo_trainer
    from posttrain.training.stage_run import StageContext

    model_dir = build_tiny_model(tmp_path / "model")
    tool_template_tokenizer.save_pretrained(model_dir)
    data = prepare_data(
        DataConfig(source="synthetic", synthetic=SyntheticConfig(num_examples=8), eval_size=2),
        tool_template_tokenizer,
    ).train
    stage = GRPOStageConfig(
        name="chat",
        rewards=[{"name": "xml_count"}],
        tools=["calculator"],
        tool_protocol="chat",
        trainer={
            "max_steps": 1,
            "per_device_train_batch_size": 2,
            "num_generations": 2,
            "max_completion_length": 8,
        },
    )
    ctx = StageContext(
        stage="grpo-chat", work_dir=tmp_path / "work", seed=0, report_to="none", precision="fp32"
    )
    trainer, _ = make_grpo_trainer(
        stage, ModelConfig(name=str(model_dir), precision="fp32"), str(model_dir), data, ctx
    )
    assert trainer.tools == [calculator] and trainer.rollout_func is None  # TRL generates and runs its loop


def test_reports_name_the_tool_count_calls_and_diffs_say_when_tools_differ(tiny_tokenizer):
    from posttrain.core.config import EvalConfig
    from posttrain.evaluation.diff import diff_reports
    from posttrain.evaluation.evaluator import evaluate
    from posttrain.evaluation.report import format_summary_table

    t = tiny_tokenizer
    model = bigram_model(t, chain(t, "\n12*7 =9", "4."), default=t.eos_token_id)
    records = [
        {"id": f"q{i}", "question": f"What is 12 times 7? ({i})", "answer": "84", "ops": 1} for i in range(3)
    ]
    with_tool = evaluate(
        model, records, EvalConfig(limit=3, max_completion_length=12, tools=["calculator"]), tokenizer=t
    )
    bare = evaluate(model, records, EvalConfig(limit=3, max_completion_length=12), tokenizer=t)
    assert with_tool.config["tools"] == ["calculator"] and "tools" not in bare.config
    assert with_tool.summary["tool_calls_per_completion"] == 1.0
    assert with_tool.summary["tool_failed_calls_per_completion"] == 0.0
    assert "tool_calls_per_completion" not in bare.summary
    assert [r.completion for r in with_tool.records] == ["12*7 = 84."] * 3
    assert [r.tool_calls for r in with_tool.records] == [1, 1, 1]
    assert with_tool.summary["accuracy_flexible"] == 1.0 and bare.summary["accuracy_flexible"] == 0.0
    assert "tools: calculator" in format_summary_table(with_tool)
    assert "tools: [] -> ['calculator']" in diff_reports(bare, with_tool).settings
