"""The benchmarks' own arithmetic: tokens generated per step and their rate, comparisons per generated
token (two variants sample different completions), agreement only where some completion answered."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str):
    """A benchmark script as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_grpo_step_counts_the_tokens_each_step_generates_and_reports_their_rate(capsys):
    bench = load("grpo_step")
    timer = bench.StepTimer()
    lengths = iter([[4, 4], [5, 3, 2], [1, 1, 1, 1]])  # completions generated at steps 0, 1, 2

    def rollout(prompts, trainer):
        return {"completion_ids": [[7] * n for n in next(lengths)], "prompt_ids": [], "logprobs": None}

    trainer = SimpleNamespace(rollout_func=rollout)
    bench.time_generation(trainer, timer)
    for _ in range(3):
        timer.on_step_begin(None, None, None)
        trainer.rollout_func(["p"], trainer)
        timer.on_step_end(None, None, None)
    assert timer.tokens == [8, 10, 4]
    _, _, per_step = bench.report("posttrain", timer, [0.5])
    assert per_step == 7.0  # the warm-up step is not counted
    line = capsys.readouterr().out
    assert " 7 tokens/step at " in line and " tok/s" in line


@pytest.mark.parametrize(
    ("posttrain", "per_step", "per_token"),
    [
        ((4.0, 6.0, 200.0), "1.00x per step", "0.50x per generated token"),  # same time, twice the tokens
        ((2.0, 4.0, 50.0), "0.50x per step", "1.00x per generated token"),  # faster only by sampling less
    ],
)
def test_grpo_step_compares_variants_per_generated_token(posttrain, per_step, per_token):
    bench = load("grpo_step")
    (line,) = bench.versus_trl({"trl": (4.0, 8.0, 100.0), "posttrain": posttrain})
    assert line.startswith(f"posttrain / TRL = {per_step}") and per_token in line


def test_eval_throughput_agreement_counts_only_questions_someone_answered():
    pytest.importorskip("torch")
    bench = load("eval_throughput")
    from posttrain.evaluation.scoring import score_completion

    def pair(a: str, b: str):
        return score_completion(a, "42"), score_completion(b, "42")

    pairs = [
        pair("so 42", "so 42"),  # agree
        pair("no idea", "still no idea"),  # neither answered: not comparable
        pair("so 42", "so 41"),  # disagree
        pair("no idea", "so 42"),  # one side answered: comparable, disagree
    ]
    assert bench.agreement(pairs) == ([0], [0, 2, 3])


def test_sft_throughput_runs_the_variants_side_by_side_and_prints_their_ratio(monkeypatch, capsys):
    """Smoke run on the tiny model: both variants train, take turns, and are compared (no timing asserted)."""
    pytest.importorskip("trl")
    bench = load("sft_throughput")
    argv = [
        "sft_throughput.py",
        "--tiny",
        "--steps",
        "1",
        "--repeats",
        "2",
        "--batch",
        "2",
        "--max-length",
        "512",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    try:
        bench.main()
    finally:  # the script turns the libraries' progress bars off, as a script may: not for later tests
        import datasets
        import transformers

        datasets.enable_progress_bars()
        transformers.utils.logging.enable_progress_bar()
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if " tok/s, " in line}  # one per variant
    for name in ("trl", "posttrain"):
        assert "of the matmul limit" in lines[name]
        assert "steps " in lines[name] and lines[name].count(" s;") >= 1
    assert "posttrain / TRL defaults = " in out and "x tokens/s" in out
    from posttrain.models.hardware import resolve_dtype, resolve_precision

    # The limit is measured in the precision the variants train in: bf16 on a CPU with fast bf16.
    assert f"matmul limit ({resolve_dtype(resolve_precision('auto'))}, " in out
    # Same seed, same rows: both variants trained on the same batches.
    tokens = {
        name: re.search(r"(\d+) real tokens/step", lines[name]).group(1) for name in ("trl", "posttrain")
    }
    assert tokens["trl"] == tokens["posttrain"]


def test_sft_throughput_counts_real_tokens_and_the_share_of_the_matmul_limit():
    bench = load("sft_throughput")
    trl = bench.Measured(wall=[2.0, 2.0], cpu=[4.0, 4.0], tokens=[100, 300], positions=[200, 400])
    line = bench.report("trl", trl, params=1_000_000, limit_gflops=1.2)
    # 400 tokens in 4 s = 100 tok/s; 6 x 1M x 100 = 0.6 GFLOP/s, half of 1.2; 200 of 600 positions padding
    assert "100.0 tok/s" in line and "50.0% of the matmul limit" in line and "33% padding" in line
    faster = bench.Measured(wall=[1.0], cpu=[2.0], tokens=[200], positions=[200])
    assert bench.versus_trl({"trl": trl, "posttrain": faster}) == [
        "posttrain / TRL defaults = 2.00x tokens/s (2.00x tokens per CPU-s)"
    ]


def test_sft_throughput_turns_alternate_blocks_of_steps_and_skip_finished_trainers():
    bench = load("sft_throughput")
    turns = bench.Turns(["a", "b", "c"])
    order = []
    for name in ("a", "b", "c", "a"):
        assert turns.wait(name, timeout=5)  # at once: it is this name's turn
        order.append(name)
        turns.pass_on(name)
    turns.pass_on("c", finished=True)  # c ends while b holds the turn
    assert not turns.wait("a", timeout=0.1)  # b still holds it
    turns.pass_on("b")
    assert turns.wait("a", timeout=5)  # c finished: the turn skips it
    assert order == ["a", "b", "c", "a"]
