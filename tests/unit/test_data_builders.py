"""SFT prompt-completion rows and on-policy DPO pair selection, in the formats TRL 1.16 expects."""

from __future__ import annotations

import pytest
from trl.data_utils import is_conversational

from posttrain.core.config import DataConfig, SyntheticConfig
from posttrain.core.errors import DataError
from posttrain.core.prompts import build_prompt, format_sft_target
from posttrain.data.builders import (
    DPO_FEATURES,
    DpoPair,
    build_dpo_dataset,
    build_rft_dataset,
    build_sft_dataset,
    select_dpo_pair,
)
from posttrain.data.prepare import prepare_data

REFERENCE = "She sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
GOOD = "<reasoning>\n48/2 = 24, 48 + 24 = 72\n</reasoning>\n<answer>\n72\n</answer>"
WRONG = "<reasoning>\n48 + 48 = 96\n</reasoning>\n<answer>\n96\n</answer>"
RAMBLE = "I think it is 72"


@pytest.fixture(scope="module")
def prepared():
    return prepare_data(DataConfig(synthetic=SyntheticConfig(num_examples=40), eval_size=4))


def test_format_sft_target():
    assert format_sft_target(REFERENCE) == (
        "<reasoning>\nShe sold 48/2 = 24 clips in May.\n</reasoning>\n<answer>\n72\n</answer>"
    )
    assert format_sft_target("#### 5").startswith("<reasoning>\nThe answer follows")  # never an empty block


def test_build_sft_dataset(prepared):
    sft = build_sft_dataset(prepared.train)
    assert sft.column_names == ["prompt", "completion"]
    assert len(sft) == len(prepared.train)
    row, source = sft[0], prepared.train[0]
    assert row["prompt"] == source["prompt"]
    assert row["completion"] == [{"role": "assistant", "content": format_sft_target(source["solution"])}]
    assert is_conversational(row)  # TRL treats it as conversational prompt-completion
    assert build_sft_dataset(prepared.train, keep_columns=("id",)).column_names == [
        "id",
        "prompt",
        "completion",
    ]
    with pytest.raises(DataError, match="missing \\['solution'\\]"):
        build_sft_dataset(prepared.train.remove_columns("solution"))


@pytest.mark.parametrize(
    ("scores", "correct", "reference", "expected"),
    [
        ([1.0, 2.5, 0.0], None, None, ("b", "c", 2.5, 0.0, False)),  # best vs worst
        ([1.0, 2.5, 0.0], [False, True, False], REFERENCE, ("b", "c", 2.5, 0.0, False)),  # best is correct
        ([0.5, 0.5, 0.1], None, None, ("a", "c", 0.5, 0.1, False)),  # tied best: first index wins
        ([1.0, 1.0, 1.0], None, None, None),  # all tied: no preference, dropped
        ([1.0, 1.0, 1.0], [True, True, True], REFERENCE, None),  # all tied and correct: dropped
        ([0.2, 0.3, 0.0], [False] * 3, REFERENCE, ("REF", "c", None, 0.0, True)),  # none correct: reference
        ([0.0, 0.0, 0.0], [False] * 3, REFERENCE, ("REF", "a", None, 0.0, True)),  # tie, but reference helps
        ([0.2, 0.3, 0.0], [False] * 3, None, ("b", "c", 0.3, 0.0, False)),  # none correct, no reference
        ([0.2, 0.3, 0.0], None, REFERENCE, ("b", "c", 0.3, 0.0, False)),  # correctness unknown: no reference
        ([0.7], [True], REFERENCE, None),  # a single completion cannot form a pair
    ],
)
def test_select_dpo_pair(scores, correct, reference, expected):
    completions = ["a", "b", "c"][: len(scores)]
    pair = select_dpo_pair(completions, scores, reference, correct=correct)
    if expected is None:
        assert pair is None
        return
    chosen, rejected, chosen_score, rejected_score, used_reference = expected
    if chosen == "REF":
        chosen = format_sft_target(REFERENCE)
    assert pair == DpoPair(chosen, rejected, chosen_score, rejected_score, used_reference)


def test_select_dpo_pair_accepts_message_completions_and_formatted_references():
    messages = [[{"role": "assistant", "content": GOOD}], [{"role": "assistant", "content": WRONG}]]
    pair = select_dpo_pair(messages, [1.0, 0.0])
    assert (pair.chosen, pair.rejected, pair.margin) == (GOOD, WRONG, 1.0)
    pair = select_dpo_pair([WRONG, RAMBLE], [0.1, 0.0], GOOD, correct=[False, False])
    assert pair.chosen == GOOD and pair.margin is None  # already formatted reference used verbatim


@pytest.mark.parametrize(
    ("completions", "scores", "correct", "message"),
    [
        ([], [], None, "at least one completion"),  # nothing to choose from
        (["a", "b"], [1.0], None, "2 completions but 1 scores"),  # misaligned scores
        (["a", "b"], [1.0, 0.0], [True], "and 1 correctness flags"),  # misaligned flags
        (["a", "b"], [float("nan"), 0.0], None, "finite"),  # NaN reward
    ],
)
def test_select_dpo_pair_rejects_bad_input(completions, scores, correct, message):
    with pytest.raises(DataError, match=message):
        select_dpo_pair(completions, scores, correct=correct)


def test_build_dpo_dataset():
    prompts = [build_prompt(f"question {i}?") for i in range(4)]
    completions = [[GOOD, WRONG], [WRONG, RAMBLE], [GOOD, GOOD], [GOOD, WRONG, RAMBLE]]
    scores = [[2.0, 0.5], [0.5, 0.0], [2.0, 2.0], [2.0, 0.5, 0.0]]
    correct = [[True, False], [False, False], [True, True], [True, False, False]]
    references = [REFERENCE, REFERENCE, REFERENCE, None]
    ds, stats = build_dpo_dataset(prompts, completions, scores, correct, references)
    assert stats == {
        "n_prompts": 4,
        "n_pairs": 3,
        "dropped_ties": 1,
        "reference_used": 1,
        "mean_margin": 1.75,
    }
    assert ds.features == DPO_FEATURES and len(ds) == 3
    first = ds[0]
    assert first["prompt"] == prompts[0]
    assert first["chosen"] == [{"role": "assistant", "content": GOOD}]
    assert first["rejected"] == [{"role": "assistant", "content": WRONG}]
    assert is_conversational(first)
    assert ds[1]["chosen"][0]["content"] == format_sft_target(REFERENCE)  # prompt 2: none correct
    assert ds[2]["rejected"][0]["content"] == RAMBLE  # prompt 4: the lowest score is rejected


def test_build_dpo_dataset_all_ties_is_empty_not_an_error(caplog):
    ds, stats = build_dpo_dataset([build_prompt("q?")], [[GOOD, GOOD]], [[1.0, 1.0]])
    assert len(ds) == 0 and ds.features == DPO_FEATURES
    assert stats["n_pairs"] == 0 and stats["dropped_ties"] == 1 and stats["mean_margin"] == 0.0
    assert "no DPO pairs" in caplog.text


def test_build_dpo_dataset_checks_lengths():
    with pytest.raises(DataError, match="2 prompts but 1 scores_per_prompt"):
        build_dpo_dataset([build_prompt("a"), build_prompt("b")], [["x"], ["y"]], [[1.0]])


def _rows(*ids):
    import datasets

    return datasets.Dataset.from_list([{"id": i, "prompt": build_prompt(f"question {i}?")} for i in ids])


def _replay(n):
    import datasets

    solution = "He paid $<<3*5=15>>15.\n#### 15"
    return datasets.Dataset.from_list(
        [{"prompt": build_prompt(f"old {i}?"), "solution": solution} for i in range(n)]
    )


def test_build_rft_dataset_pairs_each_correct_completion_with_its_prompt_and_replays_per_completion():
    right_a = GOOD
    right_b = GOOD.replace("48/2 = 24", "half is 24")
    correct = {"a": [right_a, right_b], "b": [], "c": [right_a]}
    data = build_rft_dataset(_rows("a", "b", "c"), correct, _replay(10), replay_ratio=0.5, seed=0)
    assert (data.completions, data.prompts, data.replayed) == (3, 2, 2)  # round(0.5 * 3)
    pairs = sorted((r["prompt"][-1]["content"], r["completion"][0]["content"]) for r in data.dataset)
    own = [(q, c) for q, c in pairs if not q.startswith("old")]
    assert own == [("question a?", right_a), ("question a?", right_b), ("question c?", right_a)]
    replayed = [c for q, c in pairs if q.startswith("old")]
    assert replayed == [format_sft_target("He paid $<<3*5=15>>15.\n#### 15")] * 2
    assert [r["completion"][0]["role"] for r in data.dataset] == ["assistant"] * 5
    assert is_conversational(data.dataset[0])


def test_build_rft_dataset_replay_is_capped_written_for_the_calculator_and_shuffled_by_seed():
    correct = {"a": [GOOD] * 1, "b": [GOOD]}
    data = build_rft_dataset(_rows("a", "b"), correct, _replay(3), replay_ratio=4.0, seed=0, calculator=True)
    assert data.replayed == 3 and len(data.dataset) == 5  # all three, not eight
    texts = [r["completion"][0]["content"] for r in data.dataset]
    assert texts.count(format_sft_target("He paid $<<3*5=15>>15.\n#### 15", calculator=True)) == 3
    assert "3*5 = 15" in texts[[i for i, t in enumerate(texts) if t != GOOD][0]]
    none = build_rft_dataset(_rows("a", "b"), correct, _replay(3), replay_ratio=0.0, seed=0)
    assert none.replayed == 0 and len(none.dataset) == 2
    orders = {
        seed: [
            r["prompt"][-1]["content"]
            for r in build_rft_dataset(
                _rows("a", "b"), correct, _replay(3), replay_ratio=1.0, seed=seed
            ).dataset
        ]
        for seed in range(6)
    }
    assert len({tuple(o) for o in orders.values()}) > 1  # the mix is shuffled, by the seed
    assert orders[0] == [
        r["prompt"][-1]["content"]
        for r in build_rft_dataset(_rows("a", "b"), correct, _replay(3), replay_ratio=1.0, seed=0).dataset
    ]


def test_build_rft_dataset_replays_worked_solutions_only_and_refuses_answers_alone():
    import datasets

    answers_only = [{"prompt": build_prompt(f"bare {i}?"), "solution": f"#### {i}"} for i in range(3)]
    mixed = datasets.Dataset.from_list([*answers_only, *_replay(2).to_list()])
    data = build_rft_dataset(_rows("a"), {"a": [GOOD, WRONG]}, mixed, replay_ratio=2.0, seed=0)
    assert data.replayed == 2  # the two worked ones, not the first answers alone
    assert not [r for r in data.dataset if r["prompt"][-1]["content"].startswith("bare")]
    with pytest.raises(DataError, match="rft.replay: the run's training records hold answers without"):
        build_rft_dataset(
            _rows("a"), {"a": [GOOD]}, datasets.Dataset.from_list(answers_only), replay_ratio=1.0, seed=0
        )
    alone = build_rft_dataset(
        _rows("a"), {"a": [GOOD]}, datasets.Dataset.from_list(answers_only), replay_ratio=0.0, seed=0
    )
    assert alone.replayed == 0


def test_build_rft_dataset_without_a_correct_completion_says_so():
    with pytest.raises(DataError, match="no correct completion"):
        build_rft_dataset(_rows("a"), {"a": []}, _replay(3), replay_ratio=1.0, seed=0)
