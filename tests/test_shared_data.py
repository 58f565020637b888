"""Where the tests find the real data beside the repository (../shared), and what a missing folder does."""

from __future__ import annotations

import pytest


def test_real_data_is_found_from_any_working_directory(request, monkeypatch, tmp_path):
    import conftest

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CI", "true")  # missing data fails instead of skipping
    path = request.getfixturevalue("gsm8k_train_path")
    assert path.is_absolute() and path.exists()
    assert path == conftest.REPO_ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


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
    assert str(raised.value) == f"real GSM8K train split not found at {missing}"
