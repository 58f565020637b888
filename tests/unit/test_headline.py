"""The headline rows `posttrain compare` prints: which evaluation a change is labelled as measured from."""

from __future__ import annotations

from posttrain.tracking.headline import (
    SeedRun,
    _spread,
    format_headline,
    format_seed_groups,
    repeated_seeds,
    seed_groups,
)


def evaluated(**accuracy):
    """A run's metrics: ``eval-<step>`` accuracies, and for each after the first the change from
    the evaluation before it in that run, as the pipeline logs it."""
    metrics, before = {}, None
    for step, value in accuracy.items():
        metrics[f"eval-{step}/accuracy_strict"] = value
        if before is not None:
            metrics[f"eval-{step}/delta_accuracy_strict"] = value - before
        before = value
    return metrics


def test_a_run_without_the_step_before_says_what_its_change_is_from():
    """Run A trained SFT then DPO; run B only DPO. B's DPO change is from its baseline, not from an
    SFT it never ran, and its cell says so; A's needs no note."""
    a = evaluated(baseline=0.10, sft=0.30, dpo=0.32)
    b = evaluated(baseline=0.10, dpo=0.14)
    rows = dict(format_headline([a, b], sorted({*a, *b}, key=list(a).index)))
    a_cell, b_cell = rows["  change from sft"]
    assert a_cell == "+2.0" and b_cell == "+4.0 (from baseline)"
    assert rows["  change from baseline"] == ["+20.0", "-"]  # the SFT step B did not run


def test_runs_with_the_same_steps_need_no_note():
    runs = [evaluated(baseline=0.1, sft=0.3), evaluated(baseline=0.1, sft=0.25)]
    rows = dict(format_headline(runs, list(runs[0])))
    assert rows["  change from baseline"] == ["+20.0", "+15.0"]


def test_seeds_that_all_gave_the_same_change_show_no_interval_and_no_mark():
    """A t interval over identical values has zero width: [+1.0, +1.0] * would claim a certainty
    three seeds cannot give."""
    assert _spread([0.01, 0.01, 0.01], points=True)[3] == "- (no spread)"
    assert _spread([0.0, 0.01, 0.02], points=True)[3].startswith("[")


def test_a_seed_given_twice_keeps_the_last_run_and_names_the_one_left_out():
    """Two runs of seed 1 among the run ids: the summary uses the last given and says which it
    dropped, so a rerun never silently replaces the run a user meant."""
    runs = [
        ("g", SeedRun("a" * 32, 0, evaluated(baseline=0.1, sft=0.3))),
        ("g", SeedRun("b" * 32, 1, evaluated(baseline=0.1, sft=0.2))),
        ("g", SeedRun("c" * 32, 1, evaluated(baseline=0.1, sft=0.4))),
    ]
    groups = seed_groups(runs)
    assert [r.run_id[0] for r in groups["g"]] == ["a", "c"]
    lines = format_seed_groups(groups, list(runs[0][1].metrics), repeated_seeds(runs))
    assert (
        lines[2] == "  one run per seed, the last given; left out: seed 1: bbbbbbbbbbbb (used: cccccccccccc)"
    )
    assert not any("left out" in line for line in format_seed_groups(groups, list(runs[0][1].metrics)))


def test_a_change_no_run_measured_from_the_step_before_is_labelled_by_what_it_was_measured_from():
    """Run A: SFT then GRPO stage x; run B: SFT then GRPO stages y, z. B's y was measured from its
    SFT, not from A's x listed before it: the row says "change from sft", with no note in the cell."""
    a = evaluated(baseline=0.0, sft=0.10, x=0.12)
    b = evaluated(baseline=0.0, sft=0.16, y=0.20, z=0.22)
    names = [*a, *(f"eval-{s}/{m}" for s in "yz" for m in ("accuracy_strict", "delta_accuracy_strict"))]
    rows = format_headline([a, b], names)
    assert rows[rows.index(("eval-y strict", ["-", "20.0%"])) + 1] == ("  change from sft", ["-", "+4.0"])
    assert rows[-1] == ("  change from y", ["-", "+2.0"])
