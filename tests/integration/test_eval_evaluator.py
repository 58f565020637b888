"""End-to-end evaluation of the tiny model, eval data sources, and the vLLM backend's error here."""

from __future__ import annotations

import json

import pytest

from posttrain.core.config import EvalConfig
from posttrain.core.errors import DataError, HardwareError
from posttrain.data.eval_sets import eval_records_for
from posttrain.evaluation import EvalReport, evaluate, load_eval_records, run_eval
from posttrain.models import hardware

FIELDS = {
    "id",
    "question",
    "gold",
    "completion",
    "strict",
    "flexible",
    "correct_strict",
    "correct_flexible",
    "strict_format",
    "tokens",
    "truncated",
}


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def _check_consistent(report: EvalReport, n: int, max_new: int) -> None:
    s = report.summary
    assert s["num_examples"] == len(report.records) == n
    for mode in ("strict", "flexible"):
        flags = [getattr(r, f"correct_{mode}") for r in report.records]
        assert s[f"accuracy_{mode}"] == pytest.approx(sum(flags) / n)
    assert s["strict_format_rate"] == pytest.approx(sum(r.strict_format for r in report.records) / n)
    assert s["truncation_rate"] == pytest.approx(sum(r.truncated for r in report.records) / n)
    assert s["mean_completion_tokens"] == pytest.approx(sum(r.tokens for r in report.records) / n)
    for record in report.records:
        assert set(record.as_dict()) >= FIELDS
        assert 1 <= record.tokens <= max_new
        assert record.tokens == max_new or not record.truncated  # truncated means it used the whole budget
    assert report.timings["generated_tokens"] == sum(r.tokens for r in report.records)
    assert report.timings["tokens_per_second"] > 0


def test_evaluate_tiny_model_on_synthetic(tiny, tmp_path):
    records = load_eval_records("synthetic", limit=5)
    cfg = EvalConfig(data="synthetic", limit=4, max_completion_length=16, batch_size=3)
    report = evaluate(tiny, records, cfg)
    _check_consistent(report, 4, 16)
    assert [r.id for r in report.records] == [r["id"] for r in records[:4]]  # limit = the first N, in order
    assert [r.gold for r in report.records] == [r["answer"] for r in records[:4]]
    assert [r.ops for r in report.records] == [r["ops"] for r in records[:4]]  # difficulty carried along
    assert sum(m["n"] for m in report.by_ops.values()) == 4
    assert report.config["max_completion_length"] == 16 and report.config["data_source"] == "synthetic"
    assert report.meta["dtype"] == "float32"
    assert EvalReport.load(report.save(tmp_path / "r")) == report


def test_report_has_lm_eval_scores_of_its_own_completions(tiny, monkeypatch):
    """lm-eval's gsm8k scores are computed from exactly the reported completions and golds."""
    from posttrain.evaluation import evaluator, lm_eval_gsm8k

    seen = []

    def spy(samples, references):
        seen.append((samples, references))
        return lm_eval_gsm8k.lm_eval_accuracy(samples, references)

    monkeypatch.setattr(evaluator, "lm_eval_accuracy", spy)
    records = load_eval_records("synthetic", limit=3)
    report = evaluate(tiny, records, EvalConfig(data="synthetic", limit=3, max_completion_length=8))
    [(samples, references)] = seen
    assert samples == [[r.completion] for r in report.records]
    assert references == [r["answer"] for r in records]
    assert {"lm_eval_strict_match", "lm_eval_flexible_extract"} <= set(report.summary)


def test_evaluate_with_prompts_given_and_a_datasets_dataset(tiny):
    from datasets import Dataset

    rows = [
        {"id": 7, "question": "1+1?", "answer": "2", "prompt": [{"role": "user", "content": "1+1?"}]},
        {"id": 8, "question": "2+2?", "answer": "4", "prompt": [{"role": "user", "content": "2+2?"}]},
    ]
    model, tokenizer = tiny
    report = evaluate(
        model, Dataset.from_list(rows), EvalConfig(limit=None, max_completion_length=8), tokenizer=tokenizer
    )
    _check_consistent(report, 2, 8)
    assert [r.id for r in report.records] == ["7", "8"]


def test_pass_at_k_sampling(tiny):
    records = load_eval_records("synthetic", limit=3)
    cfg = EvalConfig(limit=3, max_completion_length=8, pass_k=2, temperature=1.0, seed=3)
    report = evaluate(tiny, records, cfg, num_samples=3)
    assert report.summary["samples_per_example"] == 3
    assert {"pass@2_strict", "pass@2_flexible"} <= set(report.summary)
    assert all(r.num_samples == 3 and len(r.samples) == 3 for r in report.records)
    again = evaluate(tiny, records, cfg, num_samples=3)
    assert [r.samples for r in again.records] == [r.samples for r in report.records]  # seeded


def test_evaluate_rejects_bad_inputs(tiny):
    with pytest.raises(ValueError, match="lacks field"):
        evaluate(tiny, [{"question": "q", "answer": "1"}], EvalConfig(max_completion_length=4))
    with pytest.raises(ValueError, match="tokenizer"):
        evaluate(tiny[0], [{"id": 1, "question": "q", "answer": "1"}], EvalConfig(max_completion_length=4))
    with pytest.raises(ValueError, match="temperature"):
        evaluate(
            tiny,
            [{"id": 1, "question": "q", "answer": "1"}],
            EvalConfig(max_completion_length=4),
            num_samples=2,
        )


def test_run_eval_from_a_local_file(tiny_model_dir, tmp_path):
    data = tmp_path / "test.jsonl"
    rows = [
        {
            "question": f"What is {i} plus {i}?",
            "answer": f"{i} + {i} = <<{i}+{i}={2 * i}>>{2 * i}\n#### {2 * i}",
        }
        for i in range(1, 6)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "report"
    report = run_eval(
        str(tiny_model_dir),
        str(data),
        limit=3,
        output_dir=out,
        cfg=EvalConfig(max_completion_length=8),
        precision="fp32",
        progress=False,
    )
    assert [r.id for r in report.records] == ["test-00001", "test-00002", "test-00003"]
    assert list(report.by_ops) == ["1"] and report.by_ops["1"]["n"] == 3  # one <<...>> annotation each
    assert report.config["data_source"] == f"local:{data}" and report.config["limit"] == 3
    assert (report.config["data"], report.config["path"]) == ("local", str(data))
    assert EvalReport.load(out).summary == report.summary


def test_run_eval_defaults_come_from_its_config_and_are_recorded(tiny_model_dir, capsys):
    """Without a limit the config's applies; precision ``auto``, the default system prompt and a
    progress bar unless asked otherwise; what was used is what the report records."""
    from posttrain.core.prompts import DEFAULT_SYSTEM_PROMPT

    report = run_eval(str(tiny_model_dir), "synthetic", cfg=EvalConfig(limit=2, max_completion_length=4))
    assert len(report.records) == 2 and report.config["limit"] == 2
    assert (report.config["data"], report.config["data_source"]) == ("synthetic", "synthetic")
    assert report.config["precision"] == "auto" and report.config["system_prompt"] == DEFAULT_SYSTEM_PROMPT
    assert "2/2" in capsys.readouterr().err  # the progress bar
    quiet = run_eval(
        str(tiny_model_dir),
        "synthetic",
        limit=1,
        cfg=EvalConfig(limit=2, max_completion_length=4),
        system_prompt="Answer.",
        progress=False,
    )
    assert len(quiet.records) == 1 and quiet.config["system_prompt"] == "Answer."
    assert "1/1" not in capsys.readouterr().err


def test_vllm_backend_fails_clearly_without_gpu(tiny_model_dir, monkeypatch):
    records = [{"id": "1", "question": "1+1?", "answer": "2"}]
    monkeypatch.setattr(hardware, "cuda_available", lambda: False)
    with pytest.raises(HardwareError, match="vLLM needs a CUDA GPU"):
        evaluate(str(tiny_model_dir), records, EvalConfig(backend="vllm"))
    if hardware._importable("vllm"):
        return
    monkeypatch.setattr(hardware, "cuda_available", lambda: True)
    with pytest.raises(HardwareError, match="vLLM is not installed"):
        evaluate(str(tiny_model_dir), records, EvalConfig(backend="vllm"))


def test_synthetic_eval_data_is_a_stable_prefix():
    few, many = load_eval_records("synthetic", limit=3), load_eval_records("synthetic", limit=10)
    assert few == many[:3]
    from posttrain.data.synthetic import generate_problems

    train = {r["question"] for r in generate_problems(50, 1, 4, seed=0)}
    assert not train & {r["question"] for r in many}  # the eval seed is not the training default


def test_heldout_and_local_sources(tmp_path):
    heldout = [{"id": f"h{i}", "question": "q", "answer": str(i)} for i in range(5)]
    assert load_eval_records("heldout", heldout=heldout, limit=2) == heldout[:2]
    with pytest.raises(DataError, match="heldout"):
        load_eval_records("heldout")
    with pytest.raises(DataError, match="path"):
        load_eval_records("local")
    with pytest.raises(DataError, match="unknown"):
        load_eval_records("nope")


def test_cli_data_strings_dispatch(monkeypatch):
    import posttrain.data.eval_sets as data

    calls = []

    def fake_hub(hub_id, config, split, limit=None):
        calls.append((hub_id, split, limit))
        return type("R", (), {"records": [{"id": "x", "question": "q", "answer": "1"}]})()

    monkeypatch.setattr(data, "load_hub", fake_hub)
    assert eval_records_for("hub", limit=5)[0] == "hub:test"
    assert eval_records_for("hub:train")[0] == "hub:train"
    assert calls == [("openai/gsm8k", "test", 5), ("openai/gsm8k", "train", None)]
    name, records = eval_records_for("synthetic", limit=2)
    assert name == "synthetic" and len(records) == 2


def test_in_memory_model_precision_copy_leaves_the_original(tiny):
    import torch

    model, tokenizer = tiny
    model.train()
    report = evaluate(
        model,
        [{"id": "1", "question": "1+1?", "answer": "2"}],
        EvalConfig(max_completion_length=4),
        tokenizer=tokenizer,
        precision="bf16",
    )
    assert report.meta["dtype"] == "bfloat16"
    assert model.dtype == torch.float32 and model.training  # the caller's model is untouched
    model.eval()
