"""Cache records are JSON rebuilt by step kind: a pickle planted in the store is never unpickled,
by a run or by --dry-run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from posttrain.cache.records import RecordError, StoreRecords, decode_result, encode_result
from posttrain.cache.store import Store
from posttrain.core.results import DataResult, EvalResult, StageResult

KEY = "0123456789abcdef01234567"


class Planted:
    """Unpickling this runs a shell command that creates a file."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


RESULTS = [
    ("data", DataResult("/s/data/k", "tf", "ef", {"loaded": 64, "train_fingerprint": "tf"})),
    ("eval", EvalResult("sft", "/s/evals/sft-k", {"accuracy_strict": 0.25}, {"total_s": 1.5}, "mf")),
    (
        "grpo",
        StageResult(
            "grpo-format",
            "/s/stages/grpo-format-k",
            {"reward": 0.5, "global_step": 2},
            {"output": "o", "input_model": "i"},
            ({"step": 1, "kind": "no_signal", "value": 1.0, "message": "m", "remedy": "r"},),
            3.25,
            ("completions/completions_00001.parquet",),
            "merged",
            None,
        ),
    ),
]


@pytest.mark.parametrize(("kind", "result"), RESULTS, ids=[k for k, _ in RESULTS])
def test_results_round_trip_through_json(kind, result, tmp_path):
    records = StoreRecords(Store.at(tmp_path))
    records.write(KEY, step="x", kind=kind, result=result)
    assert json.loads((tmp_path / "results" / KEY).read_text())["kind"] == kind
    assert records.read(KEY, kind) == result


@pytest.mark.parametrize(
    ("kind", "data", "pattern"),
    [
        ("data", {"data_dir": "/d", "train_fingerprint": "t"}, "eval_fingerprint"),  # field missing
        ("eval", {**encode_result("eval", RESULTS[1][1]), "summary": "x"}, "summary"),  # wrong type
        ("os.system", {}, "unknown step kind"),  # a kind names no code
    ],
)
def test_records_are_checked_field_by_field(kind, data, pattern):
    with pytest.raises(RecordError, match=pattern):
        decode_result(kind, data)


def test_a_record_of_another_kind_or_key_is_refused(tmp_path):
    records = StoreRecords(Store.at(tmp_path))
    records.write(KEY, step="data", kind="data", result=RESULTS[0][1])
    with pytest.raises(RecordError, match="not 'eval'"):
        records.read(KEY, "eval")
    other = "f" * 24
    (tmp_path / "results" / other).write_text((tmp_path / "results" / KEY).read_text())
    with pytest.raises(RecordError, match="another key"):
        records.read(other)


def _plant(records_dir: Path, key: str, marker: Path, how: str) -> None:
    import pickle

    records_dir.mkdir(parents=True, exist_ok=True)
    if how == "pickle":
        (records_dir / key).write_bytes(pickle.dumps(Planted(marker)))
    else:  # a record in Prefect's own format that names the pickle serializer
        from prefect.filesystems import LocalFileSystem
        from prefect.results import ResultStore

        ResultStore(result_storage=LocalFileSystem(basepath=str(records_dir))).write(
            key=key, obj=Planted(marker)
        )


@pytest.mark.parametrize("how", ["pickle", "prefect-record"])
def test_store_records_never_unpickle(how, tmp_path):
    marker = tmp_path / "store" / "unpickled"
    store = Store.at(tmp_path / "store")
    _plant(store.results_dir, KEY, marker, how)
    records = StoreRecords(store)
    assert records.exists(KEY)
    with pytest.raises(RecordError, match="not a (JSON|posttrain) cache record"):
        records.read(KEY)
    assert not marker.exists()


@pytest.fixture
def tiny_cfg(tmp_path):
    from posttrain.pipeline import load_config

    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(
        "name: tiny\nmodel: {name: tiny-random, precision: fp32}\n"
        "data: {source: synthetic, synthetic: {num_examples: 24}, eval_size: 4, max_prompt_tokens: 1024}\n"
        "eval: {limit: 2, max_completion_length: 4, batch_size: 2}\n"
        f"tracking: {{enabled: false}}\norchestration: {{store: {tmp_path / 'store'}}}\n"
        f"seed: 0\n"
    )
    return load_config(cfg, [f"model.cache_dir={tmp_path / 'models'}"])


@pytest.mark.parametrize("how", ["pickle", "prefect-record"])
def test_a_planted_record_is_not_unpickled_by_dry_run_or_run(how, tiny_cfg, tmp_path):
    from posttrain.flows.pipeline_flow import posttrain_pipeline
    from posttrain.pipeline.plan import StepInputs, build_plan, preview
    from posttrain.pipeline.steps import base_model

    plan = build_plan(tiny_cfg)
    key = plan.step("data").key(tiny_cfg, StepInputs(base_model(tiny_cfg)))
    marker = tmp_path / "unpickled"
    _plant(Store.at(tmp_path / "store").results_dir, key, marker, how)

    assert preview(tiny_cfg)[0] == ("data", "run", "cache record unreadable")
    assert not marker.exists()
    summary = posttrain_pipeline(tiny_cfg)
    assert [(o["step"], o["status"]) for o in summary["outcomes"]] == [
        ("data", "ran"),
        ("eval-baseline", "ran"),
    ]
    assert not marker.exists()
    record = json.loads((tmp_path / "store" / "results" / key).read_text())  # replaced by a JSON record
    assert record["step"] == "data" and record["key"] == key
    assert {s for _, s, _ in preview(tiny_cfg)} == {"cached"}
