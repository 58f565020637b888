"""The console script: commands print what they promise; expected failures are one line, exit 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.cli import format_table, main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_data_preview_on_the_real_gsm8k_file(gsm8k_train_path, capsys):
    assert main(["data", "preview", str(gsm8k_train_path), "-n", "1"]) == 0
    out = capsys.readouterr().out
    assert "[system]" in out and "<reasoning>" in out and "[user]" in out
    assert "loaded                7473" in out
    assert "<<" not in out.split("[sft target]")[1]  # calculator annotations removed


def test_data_preview_with_a_config_measures_prompts(capsys):
    assert main(["data", "preview", str(CONFIGS / "smoke.yaml"), "-n", "1"]) == 0
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


def test_bad_record_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q?", "answer": "so #### 4"}\n{"question": "q2?", "answer": "no final"}\n')
    assert main(["data", "preview", str(bad)]) == 2
    assert f"{bad}:2:" in capsys.readouterr().err


def test_rewards_check_ranks_correct_formatted_highest(gsm8k_train_path, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the config's data path must not depend on where pytest runs
    config = str(CONFIGS / "smollm2-gsm8k-cpu.yaml")
    assert main(["rewards", "check", config, "--set", f"data.path={gsm8k_train_path}"]) == 0
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
            "--max-new-tokens",
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
