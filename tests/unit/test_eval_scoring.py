"""Scoring, reports and diffs on hand-written completions (no model)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from posttrain.core.stats import paired_difference
from posttrain.evaluation import (
    EvalRecord,
    EvalReport,
    diff_reports,
    format_diff,
    format_summary_table,
    pass_at_k,
    report_metrics,
    score_completion,
    summarize,
)
from posttrain.evaluation.report import format_by_ops, rate_text

GOOD = "<reasoning>\n6 * 7 = 42\n</reasoning>\n<answer>\n42\n</answer>"

# (completion, gold, strict, flexible, correct_strict, correct_flexible, strict_format)
SCORING_CASES = [
    (GOOD, "42", "42", "42", True, True, True),  # the trained format, right
    (GOOD, "41", "42", "42", False, False, True),  # the trained format, wrong
    ("6 * 7 = 42", "42", None, "42", False, True, False),  # right number, no answer block
    (
        "<answer>42</answer>",
        "42",
        "42",
        "42",
        True,
        True,
        False,
    ),  # block without reasoning: strict yes, format no
    ("<reasoning>\nso 42\n</reasoning>\n<answer>\n40\n</answer>", "42", "40", "40", False, False, True),
    ("<answer>\n$1,234.00\n</answer> done", "1234", "1234", "1234", True, True, False),  # currency + commas
    ("<answer>42</answer> no wait, 43", "42", "42", "43", True, False, False),  # last number after block
    ("<answer>\n42", "42", None, "42", False, True, False),  # truncated: unclosed block
    ("", "42", None, None, False, False, False),  # empty completion
    (GOOD, "He had 6*7 = <<6*7=42>>42.\n#### 42", "42", "42", True, True, True),  # raw GSM8K solution as gold
]


@pytest.mark.parametrize(("text", "gold", "strict", "flexible", "ok_strict", "ok_flex", "fmt"), SCORING_CASES)
def test_score_completion_table(text, gold, strict, flexible, ok_strict, ok_flex, fmt):
    s = score_completion(text, gold)
    assert (s.strict, s.flexible) == (strict, flexible)
    assert (s.correct_strict, s.correct_flexible, s.strict_format) == (ok_strict, ok_flex, fmt)


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (1, 0, 1, 0.0),  # greedy wrong
        (1, 1, 1, 1.0),  # greedy right
        (4, 1, 1, 0.25),  # pass@1 is the fraction correct
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2)
        (5, 2, 3, 1 - 1 / 10),  # 1 - C(3,3)/C(5,3)
        (4, 3, 2, 1.0),  # fewer than k wrong samples: always passes
    ],
)
def test_pass_at_k(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_too_few_samples():
    with pytest.raises(ValueError, match="at least 4 samples"):
        pass_at_k(2, 1, 4)


def test_summarize_with_samples_reports_pass_at_k():
    right, wrong = (
        score_completion(GOOD, "42", tokens=20),
        score_completion("no", "42", tokens=40, truncated=True),
    )
    metrics = summarize([[right, wrong], [wrong, wrong]], k=2)
    assert metrics["accuracy_strict"] == pytest.approx(0.25)  # (1/2 + 0) / 2
    assert metrics["pass@2_strict"] == pytest.approx(0.5)
    assert metrics["truncation_rate"] == pytest.approx(0.75)
    assert metrics["mean_completion_tokens"] == pytest.approx(35.0)


def _record(example_id: str, correct: bool, *, extra: tuple = ()) -> EvalRecord:
    text = GOOD if correct else GOOD.replace("\n42\n</answer>", "\n41\n</answer>")
    samples = [score_completion(text, "42", tokens=len(text) // 4), *extra]
    return EvalRecord.from_samples(example_id, f"question {example_id}?", "42", samples)


def _report(model: str, flags: dict[str, bool]) -> EvalReport:
    records = tuple(_record(i, ok) for i, ok in flags.items())
    summary = summarize([r.samples for r in records])
    return EvalReport(
        model=model,
        summary=summary,
        records=records,
        config={"data_source": "test", "limit": 4},
        timings={"seconds": 1.5, "tokens_per_second": 100.0},
        meta={"dtype": "float32"},
    )


def test_report_save_load_round_trip(tmp_path):
    sampled = _record("q3", True, extra=(score_completion("42 ü", "42", tokens=3, truncated=True),))
    report = _report("model-a", {"q1": True, "q2": False})
    report = EvalReport(
        model=report.model,
        summary=report.summary,
        records=(*report.records, sampled),
        config=report.config,
        timings=report.timings,
        meta=report.meta,
    )
    report.save(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["examples.jsonl", "report.json"]
    head = json.loads((tmp_path / "out" / "report.json").read_text())
    assert {"model", "summary", "config", "timings", "meta"} <= set(head)
    assert len((tmp_path / "out" / "examples.jsonl").read_text().splitlines()) == 3
    loaded = EvalReport.load(tmp_path / "out")
    assert loaded == report
    assert loaded.records[2].num_samples == 2 and loaded.records[2].samples[1].completion == "42 ü"


def test_report_load_of_a_non_report_says_so(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an evaluation report"):
        EvalReport.load(tmp_path)


def test_report_rejects_duplicate_ids():
    with pytest.raises(ValueError, match="unique"):
        EvalReport(model="m", summary={}, records=(_record("x", True), _record("x", False)))


def test_summary_table_shows_headline_numbers():
    table = format_summary_table(_report("model-a", {"q1": True, "q2": False}))
    assert "model-a" in table and "2 examples" in table
    assert "accuracy (strict, <answer>)" in table and "50.0% [9.5, 90.5]" in table  # Wilson, 1 of 2
    assert "100 tok/s" in table


def test_diff_groups_by_id_and_lists_unmatched():
    a = _report("before", {"q1": True, "q2": False, "q3": True, "q4": False, "only-a": True})
    b = _report("after", {"q4": True, "q3": True, "q2": False, "q1": False, "only-b": False})
    diff = diff_reports(a, b)
    assert [p[0].id for p in diff.fixed] == ["q4"]
    assert [p[0].id for p in diff.broken] == ["q1"]
    assert [p[0].id for p in diff.stayed_right] == ["q3"]
    assert [p[0].id for p in diff.stayed_wrong] == ["q2"]
    assert diff.only_in_a == ("only-a",) and diff.only_in_b == ("only-b",)
    assert diff.counts["fixed"] == 1 and diff.net == 0 and diff.matched == 4
    text = format_diff(diff, n_examples=1)
    assert "fixed (wrong in A, right in B), 1 of 1" in text and "[q4]" in text
    assert "broken (right in A, wrong in B), 1 of 1" in text and "[q1]" in text
    assert "1 only in A, 1 only in B" in text


@pytest.mark.parametrize(
    ("ids_b", "warning"),
    [
        (("q1", "q2", "q3"), "reports cover different questions: 0 only in A, 1 only in B"),
        (("q1",), "reports cover different questions: 1 only in A, 0 only in B"),
        (("q1", "q2"), None),
    ],
    ids=["only-in-b", "only-in-a", "same-questions"],
)
def test_diff_warns_about_questions_only_one_report_has(ids_b, warning, caplog):
    a = _report("a", {"q1": True, "q2": False})
    b = _report("b", dict.fromkeys(ids_b, True))
    with caplog.at_level("WARNING", logger="posttrain.evaluation.diff"):
        diff_reports(a, b)
    assert [r.getMessage() for r in caplog.records] == ([warning] if warning else [])


def test_diff_shortens_a_long_setting_to_forty_characters():
    a = _with(_report("a", {"q1": True}), "float32", system_prompt="x" * 41)
    b = _with(_report("b", {"q1": True}), "float32", system_prompt="y" * 40)
    assert diff_reports(a, b).settings == (f"system_prompt: {'x' * 37}... -> {'y' * 40}",)
    c = _with(_report("c", {"q1": True}), "float32", system_prompt="z" * 41)
    assert diff_reports(b, c).settings == (f"system_prompt: {'y' * 40} -> {'z' * 37}...",)


def test_format_diff_exactly():
    """Counts, the paired interval, one-sided unmatched questions, settings A alone had (a tool, a
    temperature) and the per-operations rows, difficulties taken from A where the reports disagree."""

    def report(model: str, rows: list[tuple[str, bool, int | None]], **config) -> EvalReport:
        records = tuple(_with_ops(*row) for row in rows)
        return EvalReport(model=model, summary={}, records=records, config=config, meta={"dtype": "float32"})

    a = report(
        "before",
        [("q1", True, 1), ("q2", False, 1), ("q3", True, 2), ("q4", False, 2), ("only-a", True, None)],
        temperature=1.0,
        seed=0,
        tools=["calculator"],
    )
    # B counts q3's operations differently: A's count is kept
    b = report(
        "after",
        [("q1", True, 1), ("q2", True, 1), ("q3", False, 3), ("q4", True, 2)],
        temperature=0.0,
        seed=1,
    )
    diff = diff_reports(a, b)
    assert (diff.model_a, diff.model_b) == ("before", "after")
    assert format_diff(diff, n_examples=0).splitlines() == [
        "A: before",
        "B: after",
        "4 questions in both reports (strict scoring); net change +1",
        "  B - A: +25.0 [-46.1, +74.7] percentage points (95% Newcombe paired score interval;"
        " McNemar's exact test p = 1)",
        "  fixed              2  (50.0%)",
        "  broken             1  (25.0%)",
        "  stayed right       1  (25.0%)",
        "  stayed wrong       0  (0.0%)",
        "  unmatched: 1 only in A, 0 only in B",
        "  generated with different settings, which change completions by themselves:",
        "    temperature: 1.0 -> 0.0",
        "    seed: 0 -> 1",
        "    tools: ['calculator'] -> []",
        "",
        "by number of operations (strict):",
        "   ops      n       A       B  fixed  broken          B - A [95% CI]",
        "     1      2   50.0%  100.0%      1       0    +50.0 [-27.3, +90.5]",
        "     2      2   50.0%   50.0%      1       1     +0.0 [-81.1, +81.1]",
    ]
    assert format_diff(diff).count("\n  [q") == 3  # three examples by default: two fixed, one broken


def test_format_diff_of_one_question_and_of_several_samples():
    one = format_diff(diff_reports(_report("a", {"q1": False}), _report("b", {"q1": True})), n_examples=0)
    assert "  fixed              1  (100.0%)" in one.splitlines()
    extra = (score_completion(GOOD, "42"),)  # a second sample: a mean difference, no McNemar
    a = EvalReport(
        model="a", summary={}, records=(_record("q1", False, extra=extra), _record("q2", True, extra=extra))
    )
    b = EvalReport(
        model="b", summary={}, records=(_record("q1", True, extra=extra), _record("q2", True, extra=extra))
    )
    assert format_diff(diff_reports(a, b)).splitlines()[3] == (
        "  B - A: +25.0 [-100.0, +100.0] percentage points (95% t interval over 2 questions' differences)"
    )
    four = diff_reports(_report("a", dict.fromkeys("wxyz", False)), _report("b", dict.fromkeys("wxyz", True)))
    assert "\nfixed (wrong in A, right in B), 3 of 4:\n" in format_diff(four)  # three examples by default
    none = format_diff(diff_reports(_report("a", {"q1": True}), _report("b", {"q2": True})))
    assert "B - A" not in none and "  fixed              0  (0.0%)" in none.splitlines()


def test_diff_refuses_an_unknown_mode_and_logs_the_settings_that_differ(caplog):
    a = _with(_report("a", {"q1": True}), "float32")
    with pytest.raises(ValueError, match="^mode must be 'strict' or 'flexible', got 'loose'$"):
        diff_reports(a, a, mode="loose")
    b = _with(_report("b", {"q1": True}), "float32", temperature=1.0, seed=2)
    with caplog.at_level("WARNING", logger="posttrain.evaluation.diff"):
        diff_reports(a, b)
    assert [r.getMessage() for r in caplog.records] == [
        "reports were generated with different settings: temperature: 0.0 -> 1.0; seed: 0 -> 2"
    ]


def _with(report: EvalReport, dtype: str, **config) -> EvalReport:
    return EvalReport(
        model=report.model,
        summary=report.summary,
        records=report.records,
        config={
            **report.config,
            "batch_size": 64,
            "refill_at": 0.5,
            "max_completion_length": 256,
            "seed": 0,
            "temperature": 0.0,
            **config,
        },
        meta={"dtype": dtype},
    )


@pytest.mark.parametrize(
    ("dtype_a", "dtype_b", "config_b", "expected"),
    [
        ("float32", "float32", {}, ()),
        ("float32", "float32", {"batch_size": 32}, ()),  # fp32 tokens do not depend on the batch
        ("bfloat16", "bfloat16", {"batch_size": 32}, ("batch_size: 64 -> 32",)),
        ("bfloat16", "bfloat16", {"refill_at": 1.0}, ("refill_at: 0.5 -> 1.0",)),
        ("float32", "bfloat16", {}, ("dtype: float32 -> bfloat16",)),
        ("bfloat16", "bfloat16", {"max_completion_length": 128}, ("max_completion_length: 256 -> 128",)),
        (
            "bfloat16",
            "bfloat16",
            {"max_completion_length": None, "max_new_tokens": 128},
            ("max_completion_length: 256 -> 128",),
        ),  # a report written before the key was renamed
        ("float32", "float32", {"system_prompt": None}, ()),  # a key one report lacks is skipped
        ("float32", "float32", {"seed": 1}, ()),  # greedy: the seed draws nothing
        ("float32", "float32", {"seed": 1, "temperature": 1.0}, ("temperature: 0.0 -> 1.0", "seed: 0 -> 1")),
    ],
)
def test_diff_names_generation_settings_that_differ(dtype_a, dtype_b, config_b, expected, caplog):
    """A diff of two reports made with different settings says so: they move completions by themselves."""
    a = _with(_report("a", {"q1": True}), dtype_a)
    b = _with(_report("b", {"q1": False}), dtype_b, **config_b)
    diff = diff_reports(a, b)
    assert diff.settings == expected
    text = format_diff(diff)
    assert ("different settings" in text) == bool(expected)
    assert all(line in text for line in expected)
    assert ("different settings" in caplog.text) == bool(expected)


def test_diff_flexible_mode_uses_flexible_flags():
    a = _report("a", {"q1": False})
    flexible_only = EvalRecord.from_samples("q1", "q?", "42", [score_completion("so 42", "42")])
    b = EvalReport(model="b", summary={}, records=(flexible_only,))
    assert len(diff_reports(a, b, mode="strict").stayed_wrong) == 1
    assert len(diff_reports(a, b, mode="flexible").fixed) == 1


def test_summarize_keeps_strict_and_flexible_apart():
    unformatted_right = score_completion("6 * 7 = 42, so 42.", "42")  # no answer block: flexible only
    formatted_then_rambles = score_completion("<answer>42</answer> or maybe 43", "42")  # strict only
    both_wrong = score_completion("<answer>13</answer>", "42")
    metrics = summarize([[unformatted_right], [formatted_then_rambles], [both_wrong], [both_wrong]])
    assert (unformatted_right.correct_strict, unformatted_right.correct_flexible) == (False, True)
    assert (formatted_then_rambles.correct_strict, formatted_then_rambles.correct_flexible) == (True, False)
    assert metrics["accuracy_strict"] == 0.25 and metrics["accuracy_flexible"] == 0.25
    metrics = summarize([[unformatted_right], [unformatted_right], [both_wrong], [formatted_then_rambles]])
    assert metrics["accuracy_strict"] == 0.25 and metrics["accuracy_flexible"] == 0.5


# --------------------------------------------------------------------------- by difficulty

RIGHT_FORMATTED = GOOD  # strict right, flexible right, formatted
RIGHT_UNFORMATTED = "6 * 7 = 42"  # strict wrong (no answer block), flexible right
STRICT_ONLY = "<answer>42</answer> or maybe 43"  # strict right, flexible wrong (last number 43)
WRONG_FORMATTED = GOOD.replace("\n42\n</answer>", "\n41\n</answer>")  # both wrong, formatted

# (id, ops, completion): three difficulties, strict and flexible disagreeing on some questions
BY_OPS_CASES = [
    ("a", 1, RIGHT_FORMATTED),  # ops 1: 2 of 2 strict, 1 of 2 flexible
    ("b", 1, STRICT_ONLY),
    ("c", 2, RIGHT_UNFORMATTED),  # ops 2: 0 of 3 strict, 1 of 3 flexible, 1 of 3 formatted
    ("d", 2, WRONG_FORMATTED),
    ("e", 2, ""),
    ("f", 4, RIGHT_FORMATTED),  # ops 4: 1 of 1
    ("g", None, RIGHT_FORMATTED),  # no difficulty known: counted overall, in no difficulty
]


def _values(metrics: dict) -> dict:
    """``metrics`` without their interval bounds (checked on their own)."""
    from posttrain.core.metric_names import is_interval_metric

    return {k: v for k, v in metrics.items() if not is_interval_metric(k)}


def _by_ops_report() -> EvalReport:
    records = tuple(
        EvalRecord.from_samples(i, f"q {i}?", "42", [score_completion(text, "42")], ops=ops)
        for i, ops, text in BY_OPS_CASES
    )
    return EvalReport(model="m", summary=summarize([r.samples for r in records]), records=records)


def test_report_breaks_accuracy_down_by_number_of_operations(tmp_path):
    from posttrain.core.stats import wilson_interval

    report = _by_ops_report()
    assert {ops: _values(m) for ops, m in report.by_ops.items()} == {
        "1": {"n": 2, "accuracy_strict": 1.0, "accuracy_flexible": 0.5, "strict_format_rate": 0.5},
        "2": {"n": 3, "accuracy_strict": 0.0, "accuracy_flexible": 1 / 3, "strict_format_rate": 1 / 3},
        "4": {"n": 1, "accuracy_strict": 1.0, "accuracy_flexible": 1.0, "strict_format_rate": 1.0},
    }
    # each difficulty's interval is over its own questions (1 of 3 flexible at ops 2)
    by_ops_2 = report.by_ops["2"]
    assert (by_ops_2["accuracy_flexible_ci_low"], by_ops_2["accuracy_flexible_ci_high"]) == pytest.approx(
        wilson_interval(1, 3)
    )
    report.save(tmp_path)
    assert json.loads((tmp_path / "report.json").read_text())["by_ops"] == report.by_ops
    first = json.loads((tmp_path / "examples.jsonl").read_text().splitlines()[0])
    assert list(first)[:4] == ["id", "question", "gold", "ops"] and first["ops"] == 1
    assert EvalReport.load(tmp_path) == report
    assert _values(report_metrics(report)) == {
        **_values(report.summary),
        "accuracy_strict/ops_1": 1.0,
        "accuracy_strict/ops_2": 0.0,
        "accuracy_strict/ops_4": 1.0,
    }
    metrics = report_metrics(report)
    assert metrics["accuracy_strict_ci_high/ops_2"] == pytest.approx(wilson_interval(0, 3)[1])
    assert metrics["accuracy_strict_ci_low/ops_4"] == pytest.approx(wilson_interval(1, 1)[0])
    table = format_summary_table(report)
    assert "by number of operations:" in table
    assert "   2      3      0.0% [0.0, 56.1]     33.3%    33.3%" in table


def test_a_sampled_report_gives_pass_at_k_per_difficulty(tmp_path):
    # Two samples per question at pass_k 2: ops 1 has one question right once (strict) and one never;
    # ops 2 has one question right in flexible scoring only, twice.
    samples = {
        "a": (1, [RIGHT_FORMATTED, WRONG_FORMATTED]),
        "b": (1, [WRONG_FORMATTED, WRONG_FORMATTED]),
        "c": (2, [RIGHT_UNFORMATTED, RIGHT_UNFORMATTED]),
    }
    records = tuple(
        EvalRecord.from_samples(i, f"q {i}?", "42", [score_completion(t, "42") for t in texts], ops=ops)
        for i, (ops, texts) in samples.items()
    )
    report = EvalReport(
        model="m", summary=summarize([r.samples for r in records], 2), records=records, config={"pass_k": 2}
    )
    assert {ops: _values(m) for ops, m in report.by_ops.items()} == {
        "1": {
            "n": 2,
            "accuracy_strict": 0.25,
            "accuracy_flexible": 0.25,
            "strict_format_rate": 1.0,
            "pass@2_strict": 0.5,
            "pass@2_flexible": 0.5,
        },
        "2": {
            "n": 1,
            "accuracy_strict": 0.0,
            "accuracy_flexible": 1.0,
            "strict_format_rate": 0.0,
            "pass@2_strict": 0.0,
            "pass@2_flexible": 1.0,
        },
    }
    metrics = report_metrics(report)
    assert metrics["pass@2_strict/ops_1"] == 0.5 and metrics["pass@2_flexible/ops_2"] == 1.0
    assert "accuracy_flexible/ops_1" not in metrics  # only pass@k joins accuracy_strict per difficulty
    report.save(tmp_path)
    assert EvalReport.load(tmp_path).by_ops == report.by_ops
    assert metrics["pass@2_strict_ci_low/ops_1"] < 0.5 < metrics["pass@2_strict_ci_high/ops_1"]
    table = format_summary_table(report)
    assert "           pass@2 strict" in table
    assert "   1      2     25.0% [2.7, 80.2]     25.0%   100.0%         50.0% [9.5, 90.5]" in table
    # Greedy reports (pass_k 1, or no pass_k recorded) keep the four fields (and their intervals).
    assert list(_values(_by_ops_report().by_ops["1"])) == [
        "n",
        "accuracy_strict",
        "accuracy_flexible",
        "strict_format_rate",
    ]


def test_reports_written_before_difficulties_still_load(tmp_path):
    report = _report("old", {"q1": True})
    report.save(tmp_path)
    lines = [json.loads(line) for line in (tmp_path / "examples.jsonl").read_text().splitlines()]
    for line in lines:
        del line["ops"]
    (tmp_path / "examples.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    loaded = EvalReport.load(tmp_path)
    assert loaded.records[0].ops is None and loaded.by_ops == {}
    assert "by number of operations" not in format_summary_table(loaded)


def test_diff_shows_a_per_difficulty_table():
    def report(name: str, texts: dict[str, str]) -> EvalReport:
        ops = {i: n for i, n, _ in BY_OPS_CASES}
        records = tuple(
            EvalRecord.from_samples(i, f"q {i}?", "42", [score_completion(t, "42")], ops=ops[i])
            for i, t in texts.items()
        )
        return EvalReport(model=name, summary={}, records=records)

    before = report("A", {i: text for i, _, text in BY_OPS_CASES})
    # B fixes d (ops 2) and e (ops 2), breaks b (ops 1) in strict scoring; g has no ops.
    after = report(
        "B", {**{i: text for i, _, text in BY_OPS_CASES}, "b": WRONG_FORMATTED, "d": GOOD, "e": GOOD}
    )
    diff = diff_reports(before, after)
    rows = {
        ops: {k: v for k, v in row.items() if not k.startswith("delta_ci")}
        for ops, row in diff.by_ops().items()
    }
    assert rows == {
        1: {"n": 2, "accuracy_a": 1.0, "accuracy_b": 0.5, "fixed": 0, "broken": 1},
        2: {"n": 3, "accuracy_a": 0.0, "accuracy_b": 2 / 3, "fixed": 2, "broken": 0},
        4: {"n": 1, "accuracy_a": 1.0, "accuracy_b": 1.0, "fixed": 0, "broken": 0},
    }
    row = diff.by_ops()[2]  # each difficulty's change has its own paired interval around it
    assert row["delta_ci_low"] < 2 / 3 < row["delta_ci_high"]
    # Newcombe's interval on each difficulty's own 2x2 table (both right, fixed, broken, neither)
    for ops, table in ((1, (1, 0, 1, 0)), (2, (0, 2, 0, 1)), (4, (1, 0, 0, 0))):
        interval = paired_difference(*table).interval
        assert (diff.by_ops()[ops]["delta_ci_low"], diff.by_ops()[ops]["delta_ci_high"]) == (
            interval.low,
            interval.high,
        ), ops
    text = format_diff(diff)
    assert "by number of operations (strict):" in text
    heading = text.splitlines()[text.splitlines().index("by number of operations (strict):") + 1]
    assert heading == "   ops      n       A       B  fixed  broken          B - A [95% CI]"
    line = next(line for line in text.splitlines() if line.startswith("     2      3"))
    assert line.startswith("     2      3    0.0%   66.7%      2       0") and "+66.7 [" in line
    flexible = diff_reports(before, after, mode="flexible").by_ops()
    assert {k: v for k, v in flexible[1].items() if not k.startswith("delta_ci")} == {
        "n": 2,
        "accuracy_a": 0.5,
        "accuracy_b": 0.5,
        "fixed": 0,
        "broken": 0,
    }


@pytest.mark.parametrize(
    ("a", "b", "agree"),
    [
        ("so 42", "it is 42", True),  # the same number
        ("so 42", "so 41", False),  # different numbers
        (GOOD, "6 * 7 = 42", False),  # same last number, one in the answer block only
        ("no idea", "so 42", False),  # one side answered
        ("so 42", "no idea", False),  # the other side answered
        ("no idea", "still no idea", None),  # neither answered: not comparable, not agreement
    ],
)
def test_answers_agree_only_where_some_side_answered(a, b, agree):
    from posttrain.evaluation.scoring import answers_agree

    assert answers_agree(score_completion(a, "42"), score_completion(b, "42")) is agree


def test_summarize_reports_every_metric_exactly():
    from posttrain.core.stats import wilson_interval

    ok = score_completion(GOOD, "42", tokens=10)
    wrong = score_completion("41", "42", tokens=20, truncated=True)
    # two questions, a quarter of their samples right: the interval is over the 2 questions
    low, high = wilson_interval(0.5, 2)
    assert summarize([[ok, wrong], [wrong, wrong]], k=1) == {
        "num_examples": 2,
        "samples_per_example": 2,
        "accuracy_strict": 0.25,
        "accuracy_strict_ci_low": low,
        "accuracy_strict_ci_high": high,
        "accuracy_flexible": 0.25,
        "accuracy_flexible_ci_low": low,
        "accuracy_flexible_ci_high": high,
        "strict_format_rate": 0.25,
        "strict_format_rate_ci_low": low,
        "strict_format_rate_ci_high": high,
        "mean_completion_tokens": 17.5,
        "truncation_rate": 0.75,
    }  # k=1: no pass@1 beside the accuracies
    assert summarize([]) == {
        "num_examples": 0,
        "samples_per_example": 0,
        "accuracy_strict": 0.0,
        "accuracy_strict_ci_low": 0.0,
        "accuracy_strict_ci_high": 1.0,
        "accuracy_flexible": 0.0,
        "accuracy_flexible_ci_low": 0.0,
        "accuracy_flexible_ci_high": 1.0,
        "strict_format_rate": 0.0,
        "strict_format_rate_ci_low": 0.0,
        "strict_format_rate_ci_high": 1.0,
        "mean_completion_tokens": 0.0,
        "truncation_rate": 0.0,
    }  # nothing measured: the interval is everything


def test_score_and_gold_helpers():
    from posttrain.evaluation.scoring import canonical_gold

    assert canonical_gold("#### 1,234") == "1234" and canonical_gold(7) == "7"
    assert canonical_gold("n/a") == "n/a"  # not a number: kept as written
    score = score_completion(GOOD, "42")
    assert (score.tokens, score.truncated) == (0, False)
    assert score.as_dict() == {
        "completion": GOOD,
        "strict": "42",
        "flexible": "42",
        "correct_strict": True,
        "correct_flexible": True,
        "strict_format": True,
        "tokens": 0,
        "truncated": False,
        "tool_calls": 0,
        "tool_failures": 0,
    }


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError) as error:
        pass_at_k(2, 3, 1)
    assert str(error.value) == "need 0 <= c <= n and k >= 1, got n=2, c=3, k=1"


def test_by_ops_groups_questions_by_difficulty_easiest_first_and_skips_unknown():
    from posttrain.evaluation.scoring import summarize_by_ops

    ok = score_completion("<reasoning>\nx\n</reasoning>\n<answer>\n1\n</answer>", "1")
    bad = score_completion("<reasoning>\nx\n</reasoning>\n<answer>\n2\n</answer>", "1")
    by_ops = summarize_by_ops([[ok], [bad], [ok], [bad], [ok]], [10, 2, 2, None, 10])
    assert list(by_ops) == ["2", "10"]  # by number, not by text
    assert _values(by_ops["2"]) == {
        "n": 2,
        "accuracy_strict": 0.5,
        "accuracy_flexible": 0.5,
        "strict_format_rate": 1.0,
    }
    assert by_ops["10"]["n"] == 2 and by_ops["10"]["accuracy_strict"] == 1.0
    with pytest.raises(ValueError, match="^2 questions but 1 ops values$"):
        summarize_by_ops([[ok], [bad]], [1])


def _answered(example_id: str, completion: str, question: str) -> EvalRecord:
    return EvalRecord.from_samples(example_id, question, "42", [score_completion(completion, "42", tokens=9)])


def test_diff_examples_show_the_question_both_answers_and_bs_completion():
    long_question = "How   many\napples " + "x" * 120
    wrong = "<reasoning>\nso\n</reasoning>\n<answer>\n41\n</answer>\nor 43"  # strict 41, flexible 43
    loose = "it is 42 " + "y" * 200  # right only when read flexibly
    a = EvalReport(model="a", summary={}, records=(_answered("q1", wrong, long_question),))
    b = EvalReport(model="b", summary={}, records=(_answered("q1", loose, long_question),))
    text = format_diff(diff_reports(a, b, mode="flexible"), n_examples=1)
    shortened_question = ("How many apples " + "x" * 120)[:97] + "..."
    assert text.splitlines()[-3:] == [
        f"  [q1] {shortened_question}",
        "    gold 42 | A answered 43 | B answered 42",
        f"    B: {(loose[:157] + '...')}",
    ]
    strict = format_diff(diff_reports(a, b), n_examples=1)  # strict: B has no <answer>, nothing fixed
    assert "[q1]" not in strict
    boxed = EvalReport(model="b", summary={}, records=(_answered("q1", "<answer>\n42\n</answer> 7", "Q?"),))
    assert format_diff(diff_reports(a, boxed), n_examples=1).splitlines()[-2] == (
        "    gold 42 | A answered 41 | B answered 42"  # strict: each <answer>, not the last number
    )
    short = EvalReport(model="b", summary={}, records=(_answered("q1", "42", "Short?"),))
    assert format_diff(diff_reports(a, short, mode="flexible")).splitlines()[-3:] == [
        f"  [q1] {shortened_question}",  # the question as A's report holds it
        "    gold 42 | A answered 43 | B answered 42",
        "    B: 42",
    ]


SUMMARY = {
    "num_examples": 4,
    "samples_per_example": 2,
    "accuracy_strict": 0.5,
    "accuracy_strict_ci_low": 0.25,
    "accuracy_strict_ci_high": 0.75,
    "accuracy_flexible": 0.75,
    "strict_format_rate": 1.0,
    "mean_completion_tokens": 12.34,
    "truncation_rate": 0.25,
    "tool_calls_per_completion": 1.5,
    "tool_failed_calls_per_completion": 0.25,
    "pass@2_strict": 0.75,
    "pass@2_strict_ci_low": 0.5,
    "pass@2_strict_ci_high": 1.0,
}


def test_summary_table_exactly():
    config = {"data_source": "heldout", "tools": ["calculator"], "temperature": 0.7}
    timings = {"tokens_per_second": 123.4, "seconds": 5.67}
    report = EvalReport(model="m", summary=SUMMARY, records=(), config=config, timings=timings)
    assert format_summary_table(report).splitlines() == [
        "model: m",
        "data: heldout, 4 examples x 2 samples (temperature 0.7)",
        "tools: calculator (accuracy with the tool; compare only with runs that used it)",
        "[brackets]: 95% Wilson score intervals over the questions",
        "-" * 54,
        "accuracy (strict, <answer>)         50.0% [25.0, 75.0]",
        "accuracy (flexible, last number)                 75.0%",
        "strict format                                   100.0%",
        "mean completion tokens                            12.3",
        "truncated (no EOS)                               25.0%",
        "tool calls per completion                         1.50",
        "failed tool calls per completion                  0.25",
        "pass@2 (strict)                    75.0% [50.0, 100.0]",
        "throughput                        123 tok/s, 5.7 s generating",
    ]


def test_summary_table_names_the_split_its_questions_are_from():
    config = {"data_source": "gsm8k-test (local)", "temperature": 0.7}
    config["dataset"] = {
        "source": "local",
        "split": "test",
        "label": "data/gsm8k/test.jsonl test split, 4 of 1,319 questions",
    }
    report = EvalReport(model="m", summary=SUMMARY, records=(), config=config)
    assert format_summary_table(report).splitlines()[:2] == [
        "model: m",
        "data: data/gsm8k/test.jsonl test split, 4 of 1,319 questions x 2 samples (temperature 0.7)",
    ]


def test_summary_table_of_a_bare_report():
    """No intervals, tools, samples, timings or questions: defaults, and nothing that is not there."""
    report = EvalReport(model="m2", summary={"accuracy_strict": 0.5}, records=(), config={"data": "gsm8k"})
    assert format_summary_table(report).splitlines() == [
        "model: m2",
        "data: gsm8k, 0 examples",
        "-" * 54,
        "accuracy (strict, <answer>)                      50.0%",
        "accuracy (flexible, last number)                  0.0%",
        "strict format                                     0.0%",
        "mean completion tokens                             0.0",
        "truncated (no EOS)                                0.0%",
    ]


def test_by_ops_table_exactly():
    by_ops = {
        "1": {
            "n": 3,
            "accuracy_strict": 2 / 3,
            "accuracy_strict_ci_low": 0.2,
            "accuracy_strict_ci_high": 0.94,
            "accuracy_flexible": 1.0,
            "strict_format_rate": 0.5,
            "pass@2_strict": 1.0,
            "pass@2_strict_ci_low": 0.44,
            "pass@2_strict_ci_high": 1.0,
        },
        "2": {
            "n": 1,
            "accuracy_strict": 0.0,
            "accuracy_flexible": 0.0,
            "strict_format_rate": 1.0,
            "pass@2_strict": 0.0,
        },
    }
    assert format_by_ops(by_ops).splitlines() == [
        " ops      n       strict [95% CI]  flexible   format             pass@2 strict",
        "   1      3    66.7% [20.0, 94.0]    100.0%    50.0%      100.0% [44.0, 100.0]",
        "   2      1                  0.0%      0.0%   100.0%                      0.0%",
    ]
    assert format_by_ops({}) == ""


def test_rate_text_with_and_without_its_interval():
    assert rate_text(SUMMARY, "accuracy_strict") == "50.0% [25.0, 75.0]"
    assert rate_text(SUMMARY, "accuracy_flexible") == "75.0%"
    assert rate_text({"accuracy_strict_ci_low": 0.1}, "accuracy_strict") == "0.0%"  # half an interval: none
    assert rate_text({}, "pass@2_strict") == "0.0%"


def _with_ops(example_id: str, correct: bool, ops: int | None) -> EvalRecord:
    return dataclasses.replace(_record(example_id, correct), ops=ops)


def test_diff_by_ops_takes_bs_difficulty_when_as_is_missing_and_skips_questions_without_one():
    a = EvalReport(
        model="a",
        summary={},
        records=(_with_ops("q0", True, None), _with_ops("q1", False, None), _with_ops("q2", True, 2)),
    )
    b = EvalReport(
        model="b",
        summary={},
        records=(_with_ops("q0", True, None), _with_ops("q1", True, 1), _with_ops("q2", True, 2)),
    )
    rows = diff_reports(a, b).by_ops()
    assert list(rows) == [1, 2]  # q0 has no difficulty in either report: left out, the others kept
    assert {k: rows[1][k] for k in ("n", "accuracy_a", "accuracy_b", "fixed", "broken")} == {
        "n": 1,
        "accuracy_a": 0.0,
        "accuracy_b": 1.0,
        "fixed": 1,
        "broken": 0,
    }
    assert rows[2]["n"] == 1 and rows[2]["delta_ci_low"] < 0 < rows[2]["delta_ci_high"]


def test_summary_table_defaults_and_the_per_operations_block():
    records = (_with_ops("q1", True, 1), _with_ops("q2", False, 2))
    summary = summarize([r.samples for r in records])
    report = EvalReport(
        model="m",
        summary=summary,
        records=records,
        config={"tools": ["calculator", "search"]},
        timings={"generated_tokens": 3},
    )
    lines = format_summary_table(report).splitlines()
    assert lines[1] == "data: ?, 2 examples"
    assert lines[2].startswith("tools: calculator, search (")
    assert lines[-6] == "throughput                        0 tok/s, 0.0 s generating"
    assert lines[-5:] == ["", "by number of operations:", *format_by_ops(report.by_ops).splitlines()]


def test_by_ops_table_with_two_pass_rates():
    row = {"n": 1, "accuracy_strict": 1.0, "accuracy_flexible": 1.0, "strict_format_rate": 1.0}
    table = format_by_ops({"1": {**row, "pass@2_strict": 1.0, "pass@4_strict": 1.0}})
    assert table.splitlines() == [
        " ops      n       strict [95% CI]  flexible   format             pass@2 strict             pass@4 strict",
        "   1      1                100.0%    100.0%   100.0%                    100.0%                    100.0%",
    ]


def test_correct_completions_keeps_each_prompts_distinct_fully_paid_completions_in_order():
    from posttrain.core.sample_score import SampleScore
    from posttrain.evaluation.pass_rate import correct_completions

    def sample(text, flag, truncated=False):  # the flag is an evaluator's; the correctness reward decides
        return SampleScore(text, None, None, flag, flag, True, 1, truncated)

    other = GOOD.replace("6 * 7 = 42", "7 * 6 = 42")
    flexible_only = "6 * 7 = 42"
    records = (
        EvalRecord.from_samples(
            "a", "q a", "42", [sample(other, True), sample(GOOD, True), sample(other, True)]
        ),
        EvalRecord.from_samples("b", "q b", "41", [sample(GOOD, True), sample(flexible_only, False)]),
        EvalRecord.from_samples(
            "c", "q c", "42", [sample(flexible_only, True), sample(GOOD + " 6", True, True)]
        ),
    )
    report = EvalReport(model="m", summary={}, records=records)
    found = correct_completions(report, {"a": "#### 42", "b": "#### 41", "c": "42"})
    assert found == {"a": [other, GOOD], "b": [], "c": []}
