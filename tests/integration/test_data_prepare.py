"""prepare_data: split, decontamination, prompts, prompt-length filter, stats, save/load, curricula."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
from pydantic import ValidationError

from posttrain.core.config import DataConfig, SyntheticConfig
from posttrain.core.errors import DataError
from posttrain.core.prompts import build_prompt
from posttrain.data.prepare import (
    FEATURES,
    PreparedData,
    decontaminate,
    filter_by_ops,
    prepare_data,
    prompt_token_lengths,
    split_records,
)
from posttrain.data.synthetic import generate_problems

NATALIA = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May?"
)


def synthetic_cfg(n: int = 200, **kwargs) -> DataConfig:
    return DataConfig(source="synthetic", synthetic=SyntheticConfig(num_examples=n), **kwargs)


def write_questions(path, questions):
    path.write_text(
        "".join(json.dumps({"question": q, "answer": "1+1 = <<1+1=2>>2\n#### 2"}) + "\n" for q in questions)
    )
    return path


# --------------------------------------------------------------------------- split


def test_split_is_deterministic_disjoint_and_complete():
    records = generate_problems(200, seed=3)
    train, held = split_records(records, 20, seed=0)
    again_train, again_held = split_records(records, 20, seed=0)
    assert [r["id"] for r in held] == [r["id"] for r in again_held]
    assert [r["id"] for r in train] == [r["id"] for r in again_train]
    train_ids, held_ids = {r["id"] for r in train}, {r["id"] for r in held}
    assert len(held) == 20 and not train_ids & held_ids and train_ids | held_ids == {r["id"] for r in records}
    assert [r["id"] for r in train] == [r["id"] for r in records if r["id"] in train_ids]  # input order kept
    assert held_ids != {r["id"] for r in split_records(records, 20, seed=1)[1]}  # the seed matters


@pytest.mark.parametrize("eval_size", [5, 6])  # equal to / larger than the data
def test_split_needs_a_training_record(eval_size):
    with pytest.raises(DataError, match=f"eval_size={eval_size} but only 5 records"):
        split_records(generate_problems(5), eval_size, seed=0)


# --------------------------------------------------------------------------- decontamination


@pytest.mark.parametrize(
    ("train_question", "n", "removed"),
    [
        pytest.param(NATALIA, 8, True, id="verbatim"),
        pytest.param(NATALIA.upper().replace(",", ""), 8, True, id="case-and-punctuation"),
        pytest.param(
            "Maria sold clips to 48 of her friends in April, and then she sold a third as many in June. "
            "How many clips did Maria sell in total?",
            8,
            True,
            id="paraphrase-sharing-8-words",  # "clips to 48 of her friends in april and"
        ),
        pytest.param(
            "In April Natalia sold 48 clips. In May she sold half of that. How many clips in both months?",
            8,
            False,
            id="same-story-no-8-word-run",
        ),
        pytest.param("Tom has 3 apples. How many apples does Tom have?", 8, False, id="unrelated"),
        pytest.param(NATALIA.replace("Natalia", "Maria"), None, False, id="exact-mode-paraphrase-kept"),
        pytest.param(NATALIA.lower() + "!", None, True, id="exact-mode-normalized-duplicate"),
    ],
)
def test_decontaminate(train_question, n, removed):
    kept, dropped = decontaminate([{"id": "t", "question": train_question}], [NATALIA], n)
    assert (len(dropped), len(kept)) == ((1, 0) if removed else (0, 1))


# --------------------------------------------------------------------------- prepare_data


def test_prepare_synthetic_columns_counts_and_prompts():
    prepared = prepare_data(synthetic_cfg(300, eval_size=30))
    stats = prepared.stats
    assert prepared.train.features == FEATURES and prepared.eval.features == FEATURES
    assert prepared.train.column_names == [
        "id",
        "question",
        "solution",
        "answer",
        "ops",
        "source",
        "prompt",
    ]
    assert stats["loaded"] == 300 and stats["eval"] == len(prepared.eval) == 30
    assert stats["decontamination"] == "exact"  # template text is shared by design in synthetic data
    assert (
        stats["loaded"]
        == stats["eval"] + stats["decontaminated"] + stats["dropped_long_prompts"] + stats["train"]
    )
    assert stats["skipped_bad"] == 0 and stats["dropped_long_prompts"] == 0  # no tokenizer: no length filter
    assert sum(stats["train_ops"].values()) == stats["train"]
    assert not set(prepared.train["id"]) & set(prepared.eval["id"])
    row = prepared.train[0]
    assert row["prompt"] == build_prompt(row["question"], DataConfig().system_prompt)
    assert [m["role"] for m in row["prompt"]] == ["system", "user"]
    assert stats["train_fingerprint"] == prepared.train._fingerprint
    assert stats["eval_fingerprint"] == prepared.eval._fingerprint


def test_data_seed_seeds_the_synthetic_problems_too():
    """One data seed (``data.synthetic.seed`` merged into it): the generator follows ``data.seed``."""
    from posttrain.data.sources import load_records

    questions = [[r["question"] for r in load_records(synthetic_cfg(20, seed=s)).records] for s in (0, 0, 1)]
    assert questions[0] == questions[1] != questions[2]
    assert questions[0] == [p["question"] for p in generate_problems(20, seed=0)]


def test_prepare_is_reproducible_and_fingerprints_are_content_hashes():
    first, second = (
        prepare_data(synthetic_cfg(100, eval_size=10)),
        prepare_data(synthetic_cfg(100, eval_size=10)),
    )
    assert first.stats == second.stats
    assert first.train.to_list() == second.train.to_list()
    assert (
        prepare_data(synthetic_cfg(100, eval_size=10, seed=1)).stats["eval_fingerprint"]
        != first.stats["eval_fingerprint"]
    )
    code = (
        "from posttrain.core.config import DataConfig, SyntheticConfig; from posttrain.data.prepare import prepare_data; "
        "cfg = DataConfig(synthetic=SyntheticConfig(num_examples=100), eval_size=10); "
        "print(prepare_data(cfg).stats['train_fingerprint'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == first.stats["train_fingerprint"]  # same lineage id in another process


def test_prepare_local_decontaminates_against_extra_eval_questions(tmp_path):
    questions = [
        f"Question number {i} asks how many {word} fit into box {i} of the store?"
        for i, word in enumerate(
            ["pens", "cups", "hats", "bags", "toys", "cans", "jars", "mugs", "pots", "caps"]
        )
    ]
    questions.append(NATALIA)
    path = write_questions(tmp_path / "train.jsonl", questions)
    cfg = DataConfig(source="local", path=str(path), eval_size=2, decontamination_ngram=8, seed=0)
    base = prepare_data(cfg)
    assert base.stats["decontamination"] == "8-gram" and base.stats["decontaminated"] == 0
    assert NATALIA in base.train["question"]  # seed 0 holds out lines 7 and 8
    paraphrase = "Maria sold clips to 48 of her friends in April. How many did she sell?"
    with_test = prepare_data(cfg, eval_questions=[paraphrase])
    assert with_test.stats["decontaminated"] == base.stats["decontaminated"] + 1
    assert NATALIA not in with_test.train["question"]


def test_few_shot_and_system_prompt_options():
    row = prepare_data(synthetic_cfg(20, eval_size=2, few_shot=2)).train[0]
    assert [m["role"] for m in row["prompt"]] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert (
        row["prompt"][2]["content"].startswith("<reasoning>\n")
        and row["prompt"][-1]["content"] == row["question"]
    )
    bare = prepare_data(synthetic_cfg(20, eval_size=2, system_prompt="")).train[0]
    assert [m["role"] for m in bare["prompt"]] == ["user"]
    with pytest.raises(ValidationError, match="less than or equal to 4"):  # the schema bounds it
        synthetic_cfg(20, eval_size=2, few_shot=9)


def test_prompt_length_filter_uses_the_chat_template(tiny_tokenizer):
    cfg = synthetic_cfg(120, eval_size=10)
    unfiltered = prepare_data(cfg)
    lengths = prompt_token_lengths(tiny_tokenizer, unfiltered.train["prompt"])
    limit = sorted(lengths)[len(lengths) // 2]
    prepared = prepare_data(cfg.model_copy(update={"max_prompt_tokens": limit}), tokenizer=tiny_tokenizer)
    assert prepared.stats["dropped_long_prompts"] == sum(n > limit for n in lengths) > 0
    assert prepared.stats["train"] == len(unfiltered.train) - prepared.stats["dropped_long_prompts"]
    assert len(prepared.eval) == 10  # held-out slice never filtered, only counted
    for prompt in prepared.train["prompt"]:
        ids = tiny_tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert len(ids) <= limit


@pytest.mark.parametrize("template", ["tokenizer", "plain"])  # shared-prefix shortcut / whole-prompt path
def test_prompt_token_lengths_are_exact(tiny_tokenizer, template):
    tokenizer = tiny_tokenizer
    if template == "plain":  # no special tokens in the rendered text: the shortcut cannot apply
        tokenizer = copy.deepcopy(tiny_tokenizer)
        tokenizer.chat_template = (
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}"
        )
    prompts = [build_prompt(p["question"], "Be brief.", ()) for p in generate_problems(60, seed=8)]
    expected = [
        len(tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=True, return_dict=False))
        for p in prompts
    ]
    assert prompt_token_lengths(tokenizer, prompts, batch_size=7) == expected
    assert prompt_token_lengths(tokenizer, []) == []


class _PrefixSensitiveTokenizer:
    """Character tokenizer that adds a start token to every encoded text, like a BOS-adding tokenizer.

    Counting a shared prefix and suffixes separately would count that start token twice, so the
    shortcut's own check must reject it and fall back to whole prompts.
    """

    added_tokens_decoder = {0: "<s>", 1: "|"}

    def apply_chat_template(self, conversation, add_generation_prompt=True, tokenize=True, return_dict=False):
        def render(messages):
            return "".join(f"|{m['role']}|{m['content']}" for m in messages) + "|assistant|"

        if not tokenize:
            return [render(c) for c in conversation]
        return [0] + list(render(conversation))

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [[0, *text] for text in texts]}


def test_prompt_token_lengths_falls_back_when_the_shortcut_is_wrong():
    prompts = [build_prompt(q, "sys") for q in ("a b c?", "what is 1+1?", "how many?")]
    expected = [1 + len("".join(f"|{m['role']}|{m['content']}" for m in p) + "|assistant|") for p in prompts]
    assert prompt_token_lengths(_PrefixSensitiveTokenizer(), prompts) == expected


def test_empty_train_set_names_the_length_filter(tiny_tokenizer):
    with pytest.raises(DataError, match=r"longer than data.max_prompt_tokens=8 \(longest: \d+ tokens\)"):
        prepare_data(synthetic_cfg(30, eval_size=5, max_prompt_tokens=8), tokenizer=tiny_tokenizer)


def test_empty_train_set_names_decontamination(tmp_path):
    path = write_questions(tmp_path / "dupes.jsonl", [NATALIA] * 5)
    with pytest.raises(
        DataError, match=r"decontamination \(8-gram overlap with eval questions\) removed all 4"
    ):
        prepare_data(DataConfig(source="local", path=str(path), eval_size=1))


def test_bad_records_are_counted_in_skip_mode(tmp_path):
    path = write_questions(
        tmp_path / "t.jsonl", [f"Distinct question {i} about {i * 7} marbles?" for i in range(6)]
    )
    path.write_text(path.read_text() + '{"question": "q", "answer": "no marker"}\n')
    prepared = prepare_data(DataConfig(source="local", path=str(path), eval_size=2, on_bad_record="skip"))
    assert prepared.stats["skipped_bad"] == 1 and prepared.stats["loaded"] == 6


# --------------------------------------------------------------------------- a GRPO stage's own source


def test_a_stage_source_is_prepared_whole_without_any_reported_question(tmp_path, tiny_tokenizer):
    run = synthetic_cfg(60, eval_size=6, selection_size=4)
    plain = prepare_data(run)
    reported = [*plain.eval["question"], *plain.selection["question"]]
    own = [f"Question {i}: how many answers does a stage of its own count, {i} or more?" for i in range(8)]
    path = write_questions(tmp_path / "answers.jsonl", [*own, reported[0], reported[-1], NATALIA])
    stage_cfg = run.model_copy(update={"source": "local", "path": str(path), "selection_size": 0})
    paraphrase = "Maria sold clips to 48 of her friends in April. How many did she sell?"
    prepared = prepare_data(
        run, tokenizer=tiny_tokenizer, eval_questions=[paraphrase], stage_sources={"grpo-own": stage_cfg}
    )
    # the run's own splits are what they were without the stage
    assert prepared.train.to_list() == prepare_data(run, eval_questions=[paraphrase]).train.to_list()
    stage = prepared.train_for("grpo-own")
    # nothing held out of it; a held-out, a selection and an evaluation question removed
    assert stage["question"] == own
    assert prepared.stats["grpo-own.loaded"] == 11 and prepared.stats["grpo-own.decontaminated"] == 3
    assert prepared.stats["grpo-own.train"] == 8
    assert stage[0]["prompt"] == build_prompt(own[0], run.system_prompt, [])
    assert prepared.stats["grpo-own.train_fingerprint"] == stage._fingerprint
    assert prepared.train_for("grpo-other") is prepared.train  # a stage without one draws from train

    prepared.save(tmp_path / "prepared")
    loaded = PreparedData.load(tmp_path / "prepared")
    assert loaded.train_for("grpo-own").to_list() == stage.to_list()
    assert loaded.train_for("grpo-own")._fingerprint == stage._fingerprint


def test_a_stage_source_with_a_selection_slice_keeps_it_out_of_every_training_set(tmp_path):
    """The slice a stage chooses its checkpoint by: cut from its source, disjoint from its prompts,
    without a question the run trains on or reports, kept with its fingerprint and chosen by the
    stage's in-training evaluation over the run's slice."""
    from posttrain.core.config import GRPOStageConfig
    from posttrain.pipeline.steps import in_training_records

    # questions under 8 words: only exact copies overlap, so every removal below is one named here
    run_path = write_questions(tmp_path / "run.jsonl", [f"How much is {i} times {i + 2}?" for i in range(40)])
    run = DataConfig(source="local", path=str(run_path), eval_size=6, selection_size=4)
    plain = prepare_data(run)
    own = [f"What is {i} plus {i + 1}?" for i in range(30)]
    run_trained = list(plain.train["question"])
    # each question twice: a copy of a slice question must leave the prompts too
    path = write_questions(tmp_path / "answers.jsonl", [*own, *own, *run_trained, plain.eval[0]["question"]])
    stage = GRPOStageConfig(
        name="own",
        rewards=[{"name": "correctness"}],
        eval_every=2,
        data={"source": "local", "path": str(path), "selection_size": 20},
    )
    prepared = prepare_data(run, stage_sources={"grpo-own": run.source_of(stage)})
    assert prepared.train.to_list() == plain.train.to_list()  # the run's splits are as they were
    chosen, trained = prepared.stage_selection["grpo-own"], prepared.train_for("grpo-own")
    chosen_qs, trained_qs = list(chosen["question"]), list(trained["question"])
    removed = prepared.stats["grpo-own.selection_decontaminated"]
    assert removed > 0 and len(chosen) == 20 - removed  # the run's questions drawn into it, left out
    assert set(chosen_qs) <= set(own) and not set(chosen_qs) & set(trained_qs)
    assert plain.eval[0]["question"] not in trained_qs + chosen_qs
    assert set(trained_qs) >= set(own) - set(chosen_qs)  # a stage may train on what the run trains on
    assert len(trained_qs) + len(chosen_qs) + removed + prepared.stats["grpo-own.decontaminated"] == 91
    assert prepared.stats["grpo-own.selection"] == len(chosen)
    assert prepared.stats["grpo-own.selection_fingerprint"] == chosen._fingerprint
    assert in_training_records(prepared, stage, "grpo-own") is chosen
    assert in_training_records(prepared, stage, "grpo-other") is prepared.selection  # the run's, for others

    prepared.save(tmp_path / "prepared")
    loaded = PreparedData.load(tmp_path / "prepared")
    assert loaded.stage_selection["grpo-own"].to_list() == chosen.to_list()
    assert loaded.stage_selection["grpo-own"]._fingerprint == chosen._fingerprint
    assert loaded.train_for("grpo-own").to_list() == trained.to_list()

    too_many = stage.model_copy(update={"data": stage.data.model_copy(update={"selection_size": 100})})
    with pytest.raises(DataError, match=r"^grpo-own's data.selection_size=100 but only 91 records"):
        prepare_data(run, stage_sources={"grpo-own": run.source_of(too_many)})


def test_no_stage_trains_on_another_stages_selection_slice(tmp_path):
    run = synthetic_cfg(30, eval_size=5)
    path = write_questions(tmp_path / "answers.jsonl", [f"What is {i} plus {i + 1}?" for i in range(40)])
    source = run.model_copy(update={"source": "local", "path": str(path), "selection_size": 0})
    prepared = prepare_data(
        run, stage_sources={"grpo-a": source, "grpo-b": source.model_copy(update={"selection_size": 10})}
    )
    chosen = set(prepared.stage_selection["grpo-b"]["question"])
    assert len(chosen) == 10 and "grpo-a" not in prepared.stage_selection
    assert not chosen & set(prepared.train_for("grpo-a")["question"])  # the same source, without b's slice
    assert prepared.stats["grpo-a.decontaminated"] == 10 and prepared.stats["grpo-a.train"] == 30


def test_a_stage_source_with_nothing_left_names_the_stage(tmp_path):
    run = synthetic_cfg(30, eval_size=5)
    held = prepare_data(run).eval["question"]
    path = write_questions(tmp_path / "answers.jsonl", held[:2])
    stage_cfg = run.model_copy(update={"source": "local", "path": str(path), "selection_size": 0})
    with pytest.raises(
        DataError, match=r"no prompts left from local data .*answers.jsonl of grpo-own: loaded 2.*2 removed"
    ):
        prepare_data(run, stage_sources={"grpo-own": stage_cfg})


# --------------------------------------------------------------------------- save / load / curricula


def test_save_load_round_trip(tmp_path):
    prepared = prepare_data(synthetic_cfg(50, eval_size=5))
    prepared.save(tmp_path / "prepared")
    loaded = PreparedData.load(tmp_path / "prepared")
    assert loaded.stats == prepared.stats
    assert (
        loaded.train.to_list() == prepared.train.to_list()
        and loaded.eval.to_list() == prepared.eval.to_list()
    )
    assert loaded.train._fingerprint == prepared.stats["train_fingerprint"]
    assert loaded.eval._fingerprint == prepared.stats["eval_fingerprint"]
    with pytest.raises(DataError, match="no stats.json"):
        PreparedData.load(tmp_path / "nothing-here")


@pytest.fixture(scope="module")
def ops_ds():
    cfg = DataConfig(synthetic=SyntheticConfig(num_examples=200, min_ops=1, max_ops=4), eval_size=5)
    return prepare_data(cfg).train


@pytest.mark.parametrize(
    ("lo", "hi", "expected"),
    [
        pytest.param(1, 1, {1}, id="single-difficulty"),
        pytest.param(2, 3, {2, 3}, id="band"),
        pytest.param(3, None, {3, 4}, id="open-upper-bound"),
        pytest.param(None, 2, {1, 2}, id="open-lower-bound"),
        pytest.param(None, None, {1, 2, 3, 4}, id="no-filter"),
    ],
)
def test_filter_by_ops(ops_ds, lo, hi, expected):
    assert set(filter_by_ops(ops_ds, lo, hi)["ops"]) == expected


def test_filter_by_ops_errors(ops_ds):
    with pytest.raises(
        DataError, match=r"no examples with ops in \[7, 9\]; the dataset has ops \[1, 2, 3, 4\]"
    ):
        filter_by_ops(ops_ds, 7, 9)
    with pytest.raises(DataError, match="min_ops"):
        filter_by_ops(ops_ds, 3, 2)


def test_config_import_does_not_load_the_data_pipeline():
    code = "import sys, posttrain.core.config; print('posttrain.data.prepare' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
