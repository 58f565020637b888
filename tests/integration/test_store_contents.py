"""Store contents are untrusted input (issue 29, classes 3 and 4).

One small pipeline (data, baseline evaluation, a LoRA SFT stage saved as an adapter, its
evaluation) fills a store once. Each test then plants something in it (a record, a ``stage.json``, a
``.result.json``, a report, a digest memo, a shared-store upload) that points outside the store or is
damaged, and checks what the planner decides: the step is recomputed (a cache miss, never a crash),
and nothing outside the store is read as an output or touched. The store is restored after each test.
The last test runs the pipeline on a store with several plants at once.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from posttrain.cache.planner import Planner
from posttrain.cache.records import StoreRecords
from posttrain.cache.shared import SharedStore
from posttrain.cache.store import Store
from posttrain.pipeline import load_config
from posttrain.pipeline.plan import StepInputs, build_plan, preview
from posttrain.pipeline.steps import base_model

CONFIG = """\
name: contents
model: {name: tiny-random, precision: fp32, lora: {r: 4, alpha: 8, dropout: 0.0}, adapter_policy: adapter}
data: {source: synthetic, synthetic: {num_examples: 24}, eval_size: 4, max_prompt_tokens: 1024}
sft: {trainer: {max_steps: 1, per_device_train_batch_size: 2}}
eval: {limit: 2, max_completion_length: 4, batch_size: 2}
tracking: {enabled: false}
"""


@dataclass
class Made:
    tmp: Path
    cfg: object
    store: Path
    outside: Path
    keys: dict[str, str]

    def record(self, step: str) -> Path:
        return self.store / "results" / self.keys[step]

    def result(self, step: str) -> dict:
        return json.loads(self.record(step).read_text())["result"]

    def rewrite(self, step: str, **changes) -> None:
        data = json.loads(self.record(step).read_text())
        data["result"].update(changes)
        self.record(step).write_text(json.dumps(data))

    def output(self, step: str) -> Path:
        result = self.result(step)
        return Path(result.get("output_dir") or result.get("data_dir") or result["report_dir"])

    def decisions(self) -> dict[str, tuple[str, str]]:
        return {step: (status, why) for step, status, why in preview(self.cfg)}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from posttrain.flows.pipeline_flow import posttrain_pipeline

    tmp = tmp_path_factory.mktemp("contents")
    (tmp / "c.yaml").write_text(CONFIG)
    cfg = load_config(
        tmp / "c.yaml", [f"orchestration.store={tmp / 'store'}", f"model.cache_dir={tmp / 'models'}"]
    )
    summary = posttrain_pipeline(cfg)
    assert [o["status"] for o in summary["outcomes"]] == ["ran"] * 4
    store = tmp / "store"
    keys = {}
    for path in (store / "results").iterdir():
        if path.is_file():
            keys[json.loads(path.read_text())["step"]] = path.name
    outside = tmp / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("not posttrain's")
    (outside / "work.tmp-1").mkdir()  # looks like a leftover to tidy
    made = Made(tmp, cfg, store, outside, keys)
    # Copies of real outputs outside the store: a record pointing at one would verify if only its
    # content were checked, so serving it proves the location is not.
    for step in ("data", "sft", "eval-baseline"):
        shutil.copytree(made.output(step), outside / step)
    shutil.copytree(store, tmp / "pristine", symlinks=True)
    return made


def _tree(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (links not followed) with its content hash or link target."""
    found = {}
    for top, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            path = Path(top, name)
            rel = str(path.relative_to(root))
            if path.is_symlink():
                found[rel] = "-> " + os.readlink(path)
            elif path.is_file():
                found[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                found[rel] = "dir"
    return found


def _entries(folder: Path) -> list[Path]:
    return sorted(folder.iterdir()) if folder.exists() else []


@pytest.fixture
def store(made):
    """The filled store, restored after the test; asserts nothing outside it changed."""
    before = _tree(made.outside)
    yield made
    assert _tree(made.outside) == before
    shutil.rmtree(made.store)
    shutil.copytree(made.tmp / "pristine", made.store, symlinks=True)


def test_the_filled_store_is_all_cached(store):
    assert {s for s, _ in store.decisions().values()} == {"cached"}


# --------------------------------------------------------------------------- pointing outside


@pytest.mark.parametrize(
    ("step", "changes"),
    [
        ("sft", lambda m: {"output_dir": str(m.outside / "sft")}),  # a verified copy, outside
        ("data", lambda m: {"data_dir": str(m.outside / "data")}),
        ("eval-baseline", lambda m: {"report_dir": str(m.outside / "eval-baseline")}),
        ("sft", lambda m: {"output_dir": str(m.output("sft")) + "/../../../outside/sft"}),  # via ..
        ("sft", lambda m: {"samples": ["../../../outside/precious.txt"]}),  # a file it would log
        ("eval-baseline", lambda m: {"sets": {"../../../outside": {"accuracy_strict": 1.0}}}),
    ],
    ids=["record-stage", "record-data", "record-eval", "record-dotdot", "record-samples", "record-sets"],
)
def test_a_record_pointing_outside_the_store_is_recomputed(step, changes, store):
    store.rewrite(step, **changes(store))
    assert store.decisions()[step] == ("run", "cache record points outside the store")


def test_a_stage_json_naming_an_adapter_base_outside_is_recomputed(store):
    """Loading follows stage.json's adapter.base, which the output fingerprint leaves out."""
    stage_json = store.output("sft") / "stage.json"
    info = json.loads(stage_json.read_text())
    assert info["adapter"]["base"]
    info["adapter"]["base"] = str(store.outside / "sft")
    stage_json.write_text(json.dumps(info))
    assert store.decisions()["sft"] == ("run", "cached output missing or modified")


def test_a_record_naming_an_adapter_base_elsewhere_is_recomputed(store):
    store.rewrite("sft", adapter_base=str(store.outside / "sft"))
    stage_json = store.output("sft") / "stage.json"
    info = json.loads(stage_json.read_text())
    info["adapter"]["base"] = str(store.outside / "sft")  # consistent with the record: still refused
    stage_json.write_text(json.dumps(info))
    assert store.decisions()["sft"] == ("run", "cached output missing or modified")


def test_an_output_whose_own_result_points_outside_is_not_adopted(store):
    """No record (a kill between rename and record): the output's .result.json is read instead."""
    result_file = store.output("sft") / ".result.json"
    result = json.loads(result_file.read_text())
    result["output_dir"] = str(store.outside / "sft")
    result_file.write_text(json.dumps(result))
    store.record("sft").unlink()
    assert store.decisions()["sft"] == (
        "run",
        "output without a cache record failed verification: recomputing",
    )


# --------------------------------------------------------------------------- damaged contents

DAMAGE = {
    "truncated": lambda text: text[: len(text) // 2],
    "a string": lambda text: json.dumps("a string where an object belongs"),
    "a list": lambda text: "[1, 2, 3]",
    "nested 100k deep": lambda text: "[" * 100_000 + "]" * 100_000,
    "nested 1k deep": lambda text: '{"a": ' * 1000 + "1" + "}" * 1000,
    "not UTF-8": lambda text: "\udcff",
    "empty": lambda text: "",
}


def _damage(path: Path, how: str) -> None:
    damaged = DAMAGE[how](path.read_text())
    path.write_bytes(damaged.encode("utf-8", "surrogateescape"))


@pytest.mark.parametrize("how", list(DAMAGE))
@pytest.mark.parametrize("step", ["data", "sft", "eval-sft"])
def test_a_damaged_record_is_recomputed(step, how, store):
    _damage(store.record(step), how)
    assert store.decisions()[step] == ("run", "cache record unreadable")


def test_a_record_of_the_wrong_shape_or_an_oversized_one_is_recomputed(store):
    store.rewrite("sft", metrics="not a mapping", fingerprints=[1, 2])
    os.truncate(store.record("eval-baseline"), 17 << 20)  # sparse: larger than any record, costs nothing
    decisions = store.decisions()
    assert decisions["sft"] == decisions["eval-baseline"] == ("run", "cache record unreadable")


@pytest.mark.parametrize("how", list(DAMAGE))
def test_a_damaged_stage_json_is_recomputed(how, store):
    _damage(store.output("sft") / "stage.json", how)
    assert store.decisions()["sft"] == ("run", "cached output missing or modified")


def test_a_stage_json_whose_adapter_is_not_an_object_is_recomputed(store):
    stage_json = store.output("sft") / "stage.json"
    info = json.loads(stage_json.read_text())
    info["adapter"] = ["not", "an", "object"]
    stage_json.write_text(json.dumps(info))
    assert store.decisions()["sft"] == ("run", "cached output missing or modified")


@pytest.mark.parametrize("how", ["truncated", "a string", "nested 100k deep"])
def test_a_damaged_result_file_of_an_unrecorded_output_is_recomputed(how, store):
    _damage(store.output("data") / ".result.json", how)
    store.record("data").unlink()
    assert store.decisions()["data"] == (
        "run",
        "output without a cache record failed verification: recomputing",
    )


@pytest.mark.parametrize(
    ("file", "how"),
    [("report.json", "a string"), ("report.json", "nested 100k deep"), ("examples.jsonl", "truncated")],
)
def test_a_damaged_report_is_recomputed_even_with_a_matching_fingerprint(file, how, store):
    """A planted report whose record carries its new fingerprint: content checks alone would serve
    it; reading it back (bounded, as `eval --diff` and tracking read it) does not."""
    from posttrain.cache.digests import fingerprint_tree

    folder = store.output("eval-baseline")
    _damage(folder / file, how)
    store.rewrite("eval-baseline", output_fingerprint=fingerprint_tree(folder))
    assert store.decisions()["eval-baseline"] == ("run", "cached output missing or modified")


@pytest.mark.parametrize("how", ["truncated", "a string", "a list", "nested 100k deep"])
def test_a_damaged_digest_memo_only_costs_hashing_again(how, store, monkeypatch):
    from posttrain.cache import digests

    memo = store.store / "results" / "digests" / "files.json"
    monkeypatch.setattr(digests, "SETTLE_NS", 0)  # the fixture's outputs are seconds old
    with digests.remembered_digests(memo):
        digests.fingerprint_tree(store.output("sft"))
    assert memo.is_file()
    _damage(memo, how)
    assert {s for s, _ in store.decisions().values()} == {"cached"}


def test_a_damaged_lineage_pointer_is_ignored(store):
    """Read only to say why a step without a record runs ("code changed: ..."): damaged, it says less."""
    for pointer in (store.store / "results" / "lineage").iterdir():
        _damage(pointer, "nested 100k deep")
    shutil.rmtree(store.output("sft"))
    store.record("sft").unlink()
    assert store.decisions()["sft"] == ("run", "no cache entry for these inputs/config")


# --------------------------------------------------------------------------- the shared store


@pytest.fixture
def shared(store, tmp_path):
    """The data step's output uploaded to a shared store, and a fresh local store to pull into."""
    from posttrain.cache.records import read_output_result

    share = SharedStore(f"file://{tmp_path / 'shared'}")
    key = store.keys["data"]
    out = store.output("data")
    assert share.push("data", key, out, read_output_result("data", out))
    record_path = tmp_path / "shared" / "records" / f"{key}.json"
    fresh = Store.at(tmp_path / "fresh")
    plan = build_plan(store.cfg)

    def decide():
        planner = Planner(plan, StoreRecords(fresh), store=fresh, shared=share)
        return planner.decide(plan.step("data"), key, StepInputs(base_model(store.cfg)))

    upload = tmp_path / "shared" / json.loads(record_path.read_text())["output"]
    return record_path, upload, decide, fresh


def test_a_sound_upload_is_pulled(shared):
    _, _, decide, _ = shared
    decision = decide()
    assert (decision.status, decision.reason) == ("cached", "pulled from the shared store")


@pytest.mark.parametrize(
    "output",
    ["outputs/../../outside", "/etc", "outputs/", "outputs/a/b", "../outside"],
)
def test_a_shared_record_naming_an_upload_outside_its_prefix_is_a_miss(output, shared, store):
    record_path, _, decide, fresh = shared
    record = json.loads(record_path.read_text())
    record["output"] = output
    record_path.write_text(json.dumps(record))
    assert decide().status == "run"
    assert _entries(fresh.root / "data") == []


def test_an_upload_that_is_a_link_outside_is_a_miss(shared, store):
    record_path, upload, decide, fresh = shared
    shutil.rmtree(upload)
    upload.symlink_to(store.outside / "data")  # a verified copy, outside the shared store
    assert decide().status == "run"


def test_an_upload_holding_a_link_outside_is_a_miss(shared, store):
    _, upload, decide, fresh = shared
    (upload / "stats.json").unlink()
    (upload / "stats.json").symlink_to(store.outside / "precious.txt")
    assert decide().status == "run"
    assert _entries(fresh.root / "data") == []


@pytest.mark.parametrize("how", ["truncated", "a string", "nested 100k deep", "not UTF-8"])
def test_a_damaged_shared_record_is_a_miss(how, shared):
    record_path, _, decide, _ = shared
    _damage(record_path, how)
    assert decide().status == "run"


@pytest.mark.parametrize("how", ["truncated", "a string", "nested 100k deep"])
def test_an_upload_with_a_damaged_result_is_a_miss_and_leaves_nothing_half_pulled(how, shared):
    _, upload, decide, fresh = shared
    _damage(upload / ".result.json", how)
    assert decide().status == "run"
    assert _entries(fresh.root / "data") == []  # nothing half pulled


# --------------------------------------------------------------------------- a real run


def test_a_run_over_planted_and_damaged_contents_recomputes_them_and_touches_nothing_outside(store):
    from posttrain.cache.digests import fingerprint_tree
    from posttrain.flows.pipeline_flow import posttrain_pipeline

    store.rewrite("data", data_dir=str(store.outside / "data"))  # points outside
    folder = store.output("eval-baseline")
    _damage(folder / "report.json", "a string")  # damaged, fingerprint planted to match
    store.rewrite("eval-baseline", output_fingerprint=fingerprint_tree(folder))
    _damage(store.output("sft") / "stage.json", "nested 100k deep")
    summary = posttrain_pipeline(store.cfg)
    statuses = {o["step"]: o["status"] for o in summary["outcomes"]}
    assert statuses["data"] == statuses["eval-baseline"] == statuses["sft"] == "ran"
    assert all(not str(o["output"]).startswith(str(store.outside)) for o in summary["outcomes"])
    assert {s for s, _ in store.decisions().values()} == {"cached"}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_reading_a_damaged_stage_json_is_one_error_naming_the_file(how, tmp_path):
    """What loading an adapter chain (or tracking) gets from a damaged stage.json: a StageError."""
    from posttrain.core.errors import StageError
    from posttrain.models.artifacts import read_stage_json

    path = tmp_path / "stage.json"
    path.write_text(json.dumps({"adapter": {"base": "/m", "base_fingerprint": "f"}, "stage": "sft"}))
    _damage(path, how)
    with pytest.raises(StageError, match=str(path)):
        read_stage_json(tmp_path)
