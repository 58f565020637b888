"""Remembered passes of the TRL/peft option checks (core/checked.py): reused only for the same
check, options, library versions and checking code; failures and non-JSON results never remembered."""

from __future__ import annotations

import pytest

from posttrain.core import checked
from posttrain.core.checked import remembered_check


@pytest.fixture
def memo(tmp_path, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("POSTTRAIN_CHECK_MEMO", raising=False)
    source = tmp_path / "check_module.py"
    source.write_text("# the checking code\n")
    calls: list[dict] = []

    def run(options, *, result=None, name="trainer.grpo", packages=("pydantic",), fail=False):
        def check():
            calls.append(options)
            if fail:
                raise ValueError("bad option")
            return dict(options) if result is None else result

        return remembered_check(name, options, check, packages=packages, source=str(source))

    run.calls, run.source = calls, source
    checked._source_digest.cache_clear()
    yield run
    checked._source_digest.cache_clear()


def test_a_pass_is_remembered(memo):
    assert memo({"max_steps": 2}) == {"max_steps": 2}
    assert memo({"max_steps": 2}) == {"max_steps": 2}
    assert memo.calls == [{"max_steps": 2}]


@pytest.mark.parametrize(
    "change",
    [
        {"options": {"max_steps": 3}},  # another value
        {"options": {"max_steps": 2.0}},  # same value, another type
        {"name": "trainer.sft"},  # another check
        {"packages": ("pydantic", "pytest")},  # another library version in the key
        {"source": "# the checking code, fixed\n"},  # the checking module changed
    ],
)
def test_any_change_checks_again(memo, change):
    memo({"max_steps": 2})
    if "source" in change:
        memo.source.write_text(change.pop("source"))
        checked._source_digest.cache_clear()  # a new process reads the file again
    options = change.pop("options", {"max_steps": 2})
    memo(options, **change)
    assert memo.calls == [{"max_steps": 2}, options]


def test_failures_and_non_json_results_are_never_remembered(memo):
    for _ in range(2):
        with pytest.raises(ValueError, match="bad option"):
            memo({"kl_coef": 0.1}, fail=True)
    assert memo({"lr": 1}, result={"lr": (1, 2)}) == {"lr": (1, 2)}  # a tuple would read back a list
    assert memo({"lr": 1}, result={"lr": (1, 2)}) == {"lr": (1, 2)}
    assert memo.calls == [{"kl_coef": 0.1}] * 2 + [{"lr": 1}] * 2


def test_the_memo_can_be_turned_off(memo, monkeypatch):
    monkeypatch.setenv("POSTTRAIN_CHECK_MEMO", "0")
    memo({"max_steps": 2})
    memo({"max_steps": 2})
    assert len(memo.calls) == 2


def test_a_remembered_trainer_check_returns_what_trl_returned(tmp_path, monkeypatch):
    from posttrain.core.trainer_options import validate_trainer_options

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path))
    options = {"max_steps": "2", "learning_rate": "1e-4", "num_generations": 4}
    first = validate_trainer_options("grpo", options)
    assert list((tmp_path / "checked-options").iterdir())
    again = validate_trainer_options("grpo", options)
    assert again == first == {"max_steps": 2, "learning_rate": 1e-4, "num_generations": 4}
    assert [type(v) for v in again.values()] == [int, float, int]
