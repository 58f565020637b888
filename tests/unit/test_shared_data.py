"""Where the tests find the real data beside the repository (../shared), and what a missing folder does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def test_real_data_is_looked_up_beside_the_repository_from_any_working_directory(
    request, monkeypatch, tmp_path
):
    import conftest

    if os.environ.get(conftest.GSM8K_TRAIN_VARIABLE):
        pytest.skip(f"{conftest.GSM8K_TRAIN_VARIABLE} points the tests elsewhere")
    expected = Path(__file__).resolve().parents[3] / "shared" / "data" / "gsm8k" / "train.jsonl"
    assert expected == conftest.GSM8K_TRAIN  # absolute: not ../shared under whatever the cwd is
    monkeypatch.chdir(tmp_path)
    path = request.getfixturevalue("gsm8k_train_path")  # a bare clone outside CI skips here
    assert path == expected and path.exists()


@pytest.mark.parametrize(
    ("ci", "outcome"),
    [
        ("true", pytest.fail.Exception),  # CI always has the data: its absence is a failure
        (None, pytest.skip.Exception),  # a bare clone elsewhere: skipped, saying where it looked
    ],
)
def test_missing_real_data_fails_in_ci_and_is_skipped_elsewhere(request, monkeypatch, tmp_path, ci, outcome):
    import conftest

    missing = tmp_path / "shared" / "data" / "gsm8k" / "train.jsonl"
    monkeypatch.setattr(conftest, "GSM8K_TRAIN", missing)
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    # A skip raised inside the test would skip this test too: catch both and check which one came.
    with pytest.raises((pytest.fail.Exception, pytest.skip.Exception)) as raised:
        request.getfixturevalue("gsm8k_train_path")
    assert raised.type is outcome
    assert str(raised.value) == (
        f"real GSM8K train split not found at {missing} (set POSTTRAIN_TEST_GSM8K_TRAIN to its path)"
    )


def test_the_variable_points_the_tests_at_a_split_elsewhere_resolved_once(monkeypatch, tmp_path):
    import conftest

    monkeypatch.chdir(tmp_path)
    assert conftest.gsm8k_train_location({"POSTTRAIN_TEST_GSM8K_TRAIN": "data/train.jsonl"}) == (
        tmp_path / "data" / "train.jsonl"
    )  # relative to where pytest starts, then absolute: tests change their working directory
    assert conftest.gsm8k_train_location({"POSTTRAIN_TEST_GSM8K_TRAIN": "/elsewhere/train.jsonl"}) == Path(
        "/elsewhere/train.jsonl"
    )
    beside = conftest.REPO_ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
    assert conftest.gsm8k_train_location({}) == beside
    assert conftest.gsm8k_train_location({"POSTTRAIN_TEST_GSM8K_TRAIN": ""}) == beside
