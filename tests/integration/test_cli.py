"""The console script: commands print what they promise; expected failures are one line, exit 2."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from posttrain import cli
from posttrain.cli import eval_table, format_table, main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_data_preview_on_the_real_gsm8k_file(gsm8k_train_path, capsys):
    assert main(["data", "preview", str(gsm8k_train_path), "-n", "1"]) == 0
    out = capsys.readouterr().out
    assert "[system]" in out and "<reasoning>" in out and "[user]" in out
    assert "loaded                7473" in out
    assert "<<" not in out.split("[sft target]")[1]  # calculator annotations removed


def test_data_preview_with_a_config_measures_prompts(smoke_config_path, capsys):
    assert main(["data", "preview", str(smoke_config_path), "-n", "1"]) == 0
    out = capsys.readouterr().out
    assert "dropped_long_prompts" in out and "prompt lengths not checked" not in out


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["data", "preview", "nope.jsonl"], "nope.jsonl: no such config"),  # missing file
        (["validate", "missing.yaml"], "missing.yaml: cannot read config"),  # missing config
        (["models", "pull", "gpt-9"], "unknown built-in model 'gpt-9'"),  # bad model
    ],
)
def test_expected_errors_are_one_line_exit_2(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1


def test_sigterm_ends_a_command_with_one_line_and_exit_143(monkeypatch, capsys):
    """`kill`, a scheduler or a container stop: the command unwinds as Ctrl-C does (exception
    handlers and `finally` blocks run) and says why it stopped, and the handler is put back."""

    def killed(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # the handler raises before this returns
        return 0

    monkeypatch.setattr(cli, "cmd_rewards_list", killed)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["rewards", "list"]) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.splitlines()[-1] == "terminated"
    assert signal.getsignal(signal.SIGTERM) is before


def test_bad_record_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q?", "answer": "so #### 4"}\n{"question": "q2?", "answer": "no final"}\n')
    assert main(["data", "preview", str(bad)]) == 2
    assert f"{bad}:2:" in capsys.readouterr().err


def test_rewards_check_ranks_correct_formatted_highest(in_clone_with_gsm8k, capsys):
    config = str(CONFIGS / "smollm2-gsm8k-cpu.yaml")
    assert main(["rewards", "check", config]) == 0
    out = capsys.readouterr().out
    assert out.count("ranks strictly highest") == 3  # the DPO stage and both GRPO stages


def test_rewards_check_flags_a_reward_that_prefers_rambling(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "name: c\nmodel: {name: tiny-random}\ngrpo:\n  stages:\n    - name: s\n      rewards:\n"
        "        - {name: length, params: {min_tokens: 100, max_tokens: 1000}}\n"
    )
    assert main(["rewards", "check", str(cfg)]) == 1
    assert "rambling score at least as high" in capsys.readouterr().out


def test_rewards_list_and_models_list(tmp_path, capsys):
    assert main(["rewards", "list"]) == 0
    assert "strict_format" in capsys.readouterr().out
    assert main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    assert "smollm2-135m-instruct  no" in capsys.readouterr().out


def test_format_table_aligns_columns():
    assert format_table([("a", 1.0), ("long", None)], ("k", "v")).splitlines() == [
        "k     v",
        "----  -----",
        "a     1.000",
        "long  -",
    ]


OUTCOMES = [
    {"step": "data", "kind": "data", "metrics": {"num_train": 64}},
    {
        "step": "eval-baseline",
        "kind": "eval",
        "metrics": {
            "accuracy_strict": 0.05,
            "accuracy_flexible": 0.5,  # not what the table shows
            "accuracy_strict/ops_1": 0.1,
            "accuracy_strict/ops_2": 0.0,
            "accuracy_strict/gsm8k": 0.01,
            "accuracy_strict/gsm8k/ops_3": 0.02,
        },
    },
    {"step": "grpo-one", "kind": "grpo", "metrics": {"reward": 0.5}},
    {
        "step": "eval-grpo-one",
        "kind": "eval",
        "metrics": {"accuracy_strict": 0.25, "accuracy_strict/ops_1": 0.5, "accuracy_strict/gsm8k": 0.03},
    },
]


@pytest.mark.parametrize(
    ("width", "header", "baseline"),
    [
        (
            200,
            "stage     heldout  ops 1  ops 2  gsm8k  gsm8k ops 3",
            "baseline  5.0%     10.0%  0.0%   1.0%   2.0%",
        ),  # everything fits
        (
            50,
            "stage     heldout  ops 1  ops 2  gsm8k",
            "baseline  5.0%     10.0%  0.0%   1.0%",
        ),  # an extra set's difficulties are left out first
        (30, "stage     heldout  gsm8k", "baseline  5.0%     1.0%"),  # then the primary's
    ],
)
def test_run_summary_shows_accuracy_per_set_and_operations_as_far_as_it_fits(width, header, baseline):
    lines = eval_table(OUTCOMES, "heldout", width).splitlines()
    assert lines[0] == "strict accuracy by evaluation set and number of operations:"
    assert lines[1] == header and lines[3] == baseline
    assert lines[4].startswith("grpo-one  25.0%") and len(lines) == 5  # one row per evaluated stage
    assert eval_table(OUTCOMES[:1], "heldout", 200) == ""


def test_eval_writes_a_report_and_diffs_two(tiny_model_dir, tmp_path, capsys):
    for name, tokens in (("a", "8"), ("b", "12")):
        argv = [
            "eval",
            "--model",
            str(tiny_model_dir),
            "--data",
            "synthetic",
            "--limit",
            "4",
            "--max-completion-length",
            tokens,
            "--precision",
            "fp32",
            "--output",
            str(tmp_path / name),
        ]
        assert main(argv) == 0
    out = capsys.readouterr().out
    assert "accuracy (strict, <answer>)" in out and (tmp_path / "a" / "examples.jsonl").exists()
    assert main(["eval", "--diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    assert "4 questions in both reports" in capsys.readouterr().out
    assert main(["eval", "--model", str(tiny_model_dir)]) == 2  # no --data


def test_run_summary_shows_each_accuracy_with_its_interval():
    outcomes = [
        {
            "step": "eval-baseline",
            "kind": "eval",
            "metrics": {
                "accuracy_strict": 0.25,
                "accuracy_strict_ci_low": 0.071,
                "accuracy_strict_ci_high": 0.591,
                "accuracy_strict/ops_1": 0.5,
                "accuracy_strict_ci_low/ops_1": 0.15,
                "accuracy_strict_ci_high/ops_1": 0.85,
            },
        }
    ]
    lines = eval_table(outcomes, "heldout", 200).splitlines()
    assert lines[0] == "strict accuracy by evaluation set and number of operations [95% Wilson intervals]:"
    assert lines[3].split("  ")[:3] == ["baseline", "25.0% [7.1, 59.1]", "50.0% [15.0, 85.0]"]
