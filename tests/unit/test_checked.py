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


def _memo_text(root) -> str:
    return "".join(p.read_text() for p in (root / "cache" / "checked-options").iterdir())


def test_the_memo_holds_a_digest_and_coerced_values_never_the_options(memo, tmp_path):
    """A remembered pass is its key (a digest) and the values coercion changed: an option's value
    reaches the file only if the check changed it, and options with a secret are not remembered."""
    options = {"run_name": "my-private-run-name", "learning_rate": "1e-4"}
    assert memo(options, result={"run_name": "my-private-run-name", "learning_rate": 1e-4}) == {
        "run_name": "my-private-run-name",
        "learning_rate": 1e-4,
    }
    text = _memo_text(tmp_path)
    assert "my-private-run-name" not in text and "run_name" not in text and "0.0001" in text
    assert memo(options) == {"run_name": "my-private-run-name", "learning_rate": 1e-4}  # rebuilt
    assert len(memo.calls) == 1
    folder = tmp_path / "cache" / "checked-options"
    assert folder.stat().st_mode & 0o077 == 0 and all(p.stat().st_mode & 0o077 == 0 for p in folder.iterdir())


@pytest.mark.parametrize(
    "options",
    [
        {"model_init_kwargs": {"token": "hf_" + "x" * 30}},  # a secret-looking key
        {"hub_model_id": "me/x", "run_name": "http://u:pw@host/x"},  # a password in a URI
        {"api_key": "abc"},
    ],
)
def test_options_holding_a_secret_are_checked_every_time_and_never_written(options, memo, tmp_path):
    memo(options)
    memo(options)
    assert len(memo.calls) == 2
    assert not (tmp_path / "cache" / "checked-options").exists()


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="nested-past-the-recursion-limit"),
        pytest.param(b'{"posttrain_checked": 2, "name": "trainer.grpo", "changed": "x"}', id="wrong-shape"),
        pytest.param(b"\xff\xfe not text", id="not-text"),
        pytest.param(b'{"posttrain_checked": 2', id="truncated"),
        pytest.param(b" " * (70 << 10), id="larger-than-an-entry"),
    ],
)
def test_a_damaged_memo_file_is_a_miss(content, memo, tmp_path):
    memo({"max_steps": 2})
    (path,) = (tmp_path / "cache" / "checked-options").iterdir()
    path.write_bytes(content)
    assert memo({"max_steps": 2}) == {"max_steps": 2}
    assert len(memo.calls) == 2


def test_deferred_memos_are_written_only_when_flushed(memo, tmp_path):
    from posttrain.core.checked import deferred_memos, flush_memos

    with deferred_memos():
        memo({"max_steps": 3})
    assert not (tmp_path / "cache").exists()  # the command failed: nothing remembered
    with deferred_memos():
        memo({"max_steps": 3})
        flush_memos()
    assert len(list((tmp_path / "cache" / "checked-options").iterdir())) == 1
