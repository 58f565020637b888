"""Pass-rate scoring (the ``score-<stage>`` step) and the prompts a GRPO stage keeps by it.

A scripted model (one Llama layer whose next token depends on the current token only) answers
``<answer>7</answer>`` with probability 3/4 and ``<answer>8</answer>`` with 1/4 whatever the
question, so a question whose gold is 7 has a pass rate of 3/4, one whose gold is 8 of 1/4, and one
whose gold is 9 of 0: the scoring must measure those through the real engine and the correctness reward.
"""

from __future__ import annotations

import json

import pytest
from scripted_models import answers_seven_mostly as answers_seven_mostly_after

from posttrain.core.config import GRPOStageConfig, PassRateConfig
from posttrain.data.pass_rates import PassRateFileError, PassRates, kept_ids, select_by_pass_rate

P_SEVEN = 0.75


def stage(**pass_rate):
    return GRPOStageConfig(
        name="scored",
        rewards=[{"name": "correctness"}],
        pass_rate=PassRateConfig(**pass_rate),
        trainer={"max_completion_length": 12, "temperature": 1.0},
    )


@pytest.fixture(scope="module")
def answers_seven_mostly(tiny_tokenizer):
    """After ``Q``: ``<answer>7</answer>`` with probability 3/4, else ``<answer>8</answer>``."""
    return answers_seven_mostly_after(tiny_tokenizer, "Q", P_SEVEN), tiny_tokenizer


def rows(golds):
    return [
        {"id": f"q{i}", "question": f"question {i}", "answer": str(gold), "prompt": "Q"}
        for i, gold in enumerate(golds)
    ]


def test_pass_rates_match_the_scripted_models_success_rates(answers_seven_mostly):
    from posttrain.evaluation.pass_rate import score_pass_rates

    model, tokenizer = answers_seven_mostly
    k = 64
    scoring = score_pass_rates((model, tokenizer), rows([7, 8, 9]), stage(samples=k), seed=0)
    rates = scoring.rates
    assert rates.samples == k and set(rates.correct) == {"q0", "q1", "q2"}
    # binomial spread at k = 64: sd 0.054 for 3/4; 0.15 is nearly three of them
    assert abs(rates.rate("q0") - P_SEVEN) < 0.15
    assert abs(rates.rate("q1") - (1 - P_SEVEN)) < 0.15
    assert rates.rate("q2") == 0.0
    # every sample is a well-formed answer (7 or 8): what fails is the number, not the format
    answered = [s.strict for r in scoring.report.records for s in r.samples]
    assert len(answered) == 3 * k and set(answered) == {"7", "8"}


def test_every_candidate_is_scored_past_an_evaluations_default_limit(answers_seven_mostly):
    from posttrain.evaluation.pass_rate import score_pass_rates

    model, tokenizer = answers_seven_mostly
    rates = score_pass_rates((model, tokenizer), rows([7, 9] * 60), stage(samples=2), seed=0).rates
    assert len(rates.correct) == 120


def test_scoring_is_reproducible_from_the_seed(answers_seven_mostly):
    from posttrain.evaluation.pass_rate import score_pass_rates

    model, tokenizer = answers_seven_mostly
    again = [score_pass_rates((model, tokenizer), rows([7]), stage(samples=16), seed=s).rates for s in (3, 3)]
    assert again[0] == again[1]


def test_scoring_renders_prompts_with_the_stages_chat_template_options(answers_seven_mostly, monkeypatch):
    """The rollouts render a prompt with the stage's ``chat_template_kwargs`` (TRL's option); so
    does the scoring, or it would measure pass rates on other prompts than the stage trains on."""
    from posttrain.evaluation import evaluator
    from posttrain.evaluation.pass_rate import score_pass_rates

    model, tokenizer = answers_seven_mostly
    seen = []
    encode = evaluator.encode_prompts

    def spy(tok, chats, **kwargs):
        seen.append(kwargs)
        return encode(tok, chats, **kwargs)

    monkeypatch.setattr(evaluator, "encode_prompts", spy)
    cfg = stage(samples=2).model_copy(
        update={"trainer": {"max_completion_length": 12, "chat_template_kwargs": {"enable_thinking": False}}}
    )
    chats = [{**row, "prompt": [{"role": "user", "content": "Q"}]} for row in rows([7])]
    score_pass_rates((model, tokenizer), chats, cfg, seed=0)
    assert seen == [{"enable_thinking": False}]


# --------------------------------------------------------------------------- what a stage keeps


def test_the_band_is_open_and_keeps_what_is_sometimes_solved():
    rates = PassRates(4, {"never": 0, "once": 1, "half": 2, "often": 3, "always": 4})
    assert kept_ids(rates, PassRateConfig(samples=4)) == ["once", "half", "often"]
    assert kept_ids(rates, PassRateConfig(samples=4, band=(0.25, 1.0))) == ["half", "often"]
    with pytest.raises(ValueError, match=r"band: \[0.5, 0.5\] is not 0 <= low < high <= 1"):
        PassRateConfig(band=(0.5, 0.5))


@pytest.fixture(scope="module")
def prepared(tiny_tokenizer):
    from posttrain.core.config import DataConfig, SyntheticConfig
    from posttrain.data.prepare import prepare_data

    return prepare_data(
        DataConfig(source="synthetic", synthetic=SyntheticConfig(num_examples=24), eval_size=4),
        tiny_tokenizer,
    ).train


def test_variance_weighting_draws_prompts_near_one_half_most(prepared):
    ids = [str(i) for i in prepared["id"]]
    rates = PassRates(8, {ids[0]: 4, ids[1]: 1, ids[2]: 8, ids[3]: 0})
    picked = select_by_pass_rate(prepared, rates, PassRateConfig(samples=8, weighting="variance"), seed=0)
    drawn = [str(i) for i in picked["id"]]
    assert len(drawn) == 2 and set(drawn) <= {ids[0], ids[1]}
    many = PassRates(8, {ids[0]: 4, ids[1]: 1, **{i: 8 for i in ids[2:]}})
    weighted = PassRateConfig(samples=8, weighting="variance")
    counts = {ids[0]: 0, ids[1]: 0}
    for seed in range(40):
        for pid in select_by_pass_rate(prepared, many, weighted, seed)["id"]:
            counts[str(pid)] += 1
    # weights 0.25 and 7/64 ≈ 0.11: the prompt at one half comes round about twice as often
    assert counts[ids[0]] > 1.5 * counts[ids[1]]


def test_a_prompt_outside_the_band_never_reaches_the_trainer(prepared, tiny_model_dir, tmp_path):
    from posttrain.core.config import ModelConfig
    from posttrain.training.grpo import make_grpo_trainer
    from posttrain.training.stage_run import StageContext

    ids = [str(i) for i in prepared["id"]]
    solved, never, learning = ids[:6], ids[6:12], ids[12:]
    rates = PassRates(
        4, {**dict.fromkeys(solved, 4), **dict.fromkeys(never, 0), **dict.fromkeys(learning, 2)}
    )
    cfg = stage(samples=4).model_copy(
        update={"trainer": {"max_steps": 1, "num_generations": 2, "per_device_train_batch_size": 2}}
    )
    ctx = StageContext(stage="grpo-scored", work_dir=tmp_path, seed=0, report_to="none", precision="fp32")
    trainer, _ = make_grpo_trainer(
        cfg, ModelConfig(name=str(tiny_model_dir)), str(tiny_model_dir), prepared, ctx, pass_rates=rates
    )
    trained = {str(i) for i in trainer.train_dataset["id"]}
    assert trained == set(learning)


def test_a_stage_with_pass_rate_refuses_to_train_without_its_scores(prepared):
    from posttrain.core.errors import StageError
    from posttrain.training.grpo import stage_prompts

    with pytest.raises(StageError, match=r"needs its score-grpo-scored step's pass rates"):
        stage_prompts(stage(), prepared, None, seed=0)
    nothing_in_band = PassRates(4, dict.fromkeys((str(i) for i in prepared["id"]), 4))
    with pytest.raises(StageError, match=r"none of the 20 scored prompts .*completions: \[0, 0, 0, 0, 20\]"):
        stage_prompts(stage(samples=4), prepared, nothing_in_band, seed=0)


# --------------------------------------------------------------------------- the file, as store content


@pytest.mark.parametrize(
    "content, problem",
    [
        ("{", "not a pass-rate file"),
        ('{"posttrain_pass_rates": 2, "samples": 4, "correct": {}}', "not a posttrain pass-rate file"),
        ('{"posttrain_pass_rates": 1, "samples": 0, "correct": {}}', r"samples must be an int in 1..1024"),
        (
            '{"posttrain_pass_rates": 1, "samples": 1000000000000000, "correct": {"a": 0}}',
            r"samples must be an int in 1..1024",
        ),
        (
            '{"posttrain_pass_rates": 1, "samples": 4, "correct": {"a": 5}}',
            r"correct.a: 5 is not an int in 0..4",
        ),
        ('{"posttrain_pass_rates": 1, "samples": 4, "correct": {"a": 1.5}}', r"correct.a: 1.5 is not an int"),
        (
            '{"posttrain_pass_rates": 1, "samples": 4, "correct": {"a": true}}',
            r"correct.a: True is not an int",
        ),
        ("[" * 200 + "]" * 200, "not a pass-rate file"),
    ],
    ids=[
        "truncated",
        "other version",
        "no samples",
        "absurd k",
        "count above k",
        "fraction",
        "bool",
        "too deep",
    ],
)
def test_a_damaged_pass_rate_file_is_refused(tmp_path, content, problem):
    (tmp_path / "pass_rates.json").write_text(content)
    with pytest.raises(PassRateFileError, match=problem):
        PassRates.load(tmp_path)


def test_pass_rates_round_trip(tmp_path):
    rates = PassRates(4, {"a": 0, "b": 3})
    rates.save(tmp_path)
    assert PassRates.load(tmp_path) == rates and rates.histogram() == [1, 0, 0, 1, 0]
    assert json.loads((tmp_path / "pass_rates.json").read_text())["posttrain_pass_rates"] == 1
