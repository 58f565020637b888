"""`orchestration.shared_store`: finished outputs shared between stores through fsspec.

The shared store is a second local folder reached through a ``file://`` URL, so the code path is the
one an object store or a shared mount takes (fsspec's filesystem API, no local shortcuts).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

STEPS = ["data", "eval-baseline", "sft", "eval-sft"]


@pytest.fixture(scope="module")
def smoke(smoke_config):
    """``smoke(tmp, store, shared, *overrides)``: data, baseline evaluation, SFT and its evaluation (one
    step of each kind) in ``tmp/store``, sharing through the folder ``shared``."""

    def build(tmp: Path, store: str, shared: Path, *overrides: str):
        cut = ("dpo=null", "grpo.stages=[]")
        return smoke_config(tmp, f"orchestration.shared_store=file://{shared}", *cut, *overrides, store=store)

    return build


def statuses(summary) -> dict[str, str]:
    return {o["step"]: o["status"] for o in summary["outcomes"]}


@pytest.fixture(scope="module")
def shared_run(smoke, tmp_path_factory):
    """One run into store A that fills the shared store."""
    from posttrain.flows.pipeline_flow import posttrain_pipeline

    tmp = tmp_path_factory.mktemp("shared")
    summary = posttrain_pipeline(smoke(tmp, "store-a", tmp / "shared"))
    return tmp, summary


def test_a_fresh_store_reuses_every_step_from_the_shared_store(smoke, shared_run, step_calls):
    from posttrain.flows.pipeline_flow import posttrain_pipeline

    tmp, first = shared_run
    assert statuses(first) == dict.fromkeys(STEPS, "ran")
    records = sorted(p.stem for p in (tmp / "shared" / "records").glob("*.json"))
    assert records == sorted(o["key"] for o in first["outcomes"])

    summary = posttrain_pipeline(smoke(tmp, "store-b", tmp / "shared"))
    assert step_calls == []
    assert statuses(summary) == dict.fromkeys(STEPS, "cached")
    assert {o["reason"] for o in summary["outcomes"]} == {"pulled from the shared store"}
    # Every output is in store B and its result points there, so the next run is a plain local hit.
    for outcome in summary["outcomes"]:
        assert Path(outcome["output"]).is_relative_to(tmp / "store-b"), outcome
    again = posttrain_pipeline(smoke(tmp, "store-b", tmp / "shared"))
    assert {o["reason"].split()[0] for o in again["outcomes"]} == {"cache"}
    assert step_calls == []


def test_a_tampered_shared_output_is_verified_and_recomputed(smoke, shared_run, step_calls):
    from posttrain.flows.pipeline_flow import posttrain_pipeline

    tmp, first = shared_run
    sft_key = next(o["key"] for o in first["outcomes"] if o["step"] == "sft")
    record = json.loads((tmp / "shared" / "records" / f"{sft_key}.json").read_text())
    weights = tmp / "shared" / record["output"] / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))

    summary = posttrain_pipeline(smoke(tmp, "store-c", tmp / "shared", "eval.baseline=false"))
    assert statuses(summary)["sft"] == "ran"
    assert "sft_step" in step_calls and "prepare_step" not in step_calls
    # The recomputed output replaced the bad shared copy.
    replaced = json.loads((tmp / "shared" / "records" / f"{sft_key}.json").read_text())
    assert replaced["output"] != record["output"]


def test_an_interrupted_upload_leaves_no_record(tmp_path, monkeypatch):
    from posttrain.cache.shared import SharedStore
    from posttrain.core.results import DataResult

    out = tmp_path / "data" / "x"
    out.mkdir(parents=True)
    (out / "train.arrow").write_bytes(b"rows")
    shared = SharedStore(f"file://{tmp_path / 'shared'}")

    def put_then_fail(*args, **kwargs):
        raise OSError("connection reset")

    monkeypatch.setattr(shared.fs, "put", put_then_fail)
    assert not shared.push("data", "0" * 24, out, DataResult(str(out), "t", "e"))
    assert not shared.has("0" * 24)


def test_a_record_without_its_upload_is_a_miss(tmp_path):
    from posttrain.cache.shared import SHARED_VERSION, SharedStore

    shared = SharedStore(f"file://{tmp_path / 'shared'}")
    key = "0" * 24
    records = tmp_path / "shared" / "records"
    records.mkdir(parents=True)
    (records / f"{key}.json").write_text(
        json.dumps({"posttrain_shared": SHARED_VERSION, "key": key, "kind": "sft", "output": "outputs/gone"})
    )
    target = tmp_path / "store" / "stages" / "sft-000000000000"
    assert shared.has(key)
    assert not shared.pull("sft", key, target)
    assert not target.parent.exists() or not any(target.parent.iterdir())  # no half-written download


@pytest.mark.parametrize(
    "record",
    [
        {"key": "0" * 24, "kind": "sft", "output": "outputs/x"},  # no version: not ours
        {"posttrain_shared": 1, "key": "1" * 24, "kind": "sft", "output": "outputs/x"},  # another key's
        {"posttrain_shared": 1, "key": "0" * 24, "kind": "sft", "output": "../../etc"},  # outside outputs/
        {"posttrain_shared": 1, "key": "0" * 24, "kind": "sft", "output": "outputs/../../x"},  # escapes
    ],
)
def test_records_that_are_not_ours_are_ignored(tmp_path, record):
    from posttrain.cache.shared import SharedStore

    (tmp_path / "records").mkdir()
    (tmp_path / "records" / f"{'0' * 24}.json").write_text(json.dumps(record))
    assert SharedStore(f"file://{tmp_path}").record("0" * 24) is None


def test_adapter_outputs_are_not_shared(tmp_path):
    from posttrain.cache.shared import SharedStore
    from posttrain.core.results import StageResult

    out = tmp_path / "stages" / "sft-x"
    out.mkdir(parents=True)
    adapter = StageResult("sft", str(out), {}, {}, artifact="adapter", adapter_base="/elsewhere/base")
    shared = SharedStore(f"file://{tmp_path / 'shared'}")
    assert not shared.push("sft", "0" * 24, out, adapter)
    assert not (tmp_path / "shared" / "records").exists()
