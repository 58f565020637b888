"""core/atomic: where a step keeps its checkpoints, how they are discarded, and the result file a
step leaves in its output (what a store that lost its records adopts the output from)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from posttrain.core.atomic import RESULT_FILE, checkpoints_dir, discard_checkpoints, write_result


def test_checkpoints_live_beside_the_output_under_its_absolute_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = checkpoints_dir("stages/sft-0123456789ab")
    assert folder == tmp_path / "stages" / "sft-0123456789ab.ckpt"
    assert folder.is_absolute()


def test_discard_checkpoints_removes_only_them_and_says_whether_there_were_any(tmp_path):
    output = tmp_path / "stages" / "grpo-a-0123456789ab"
    output.mkdir(parents=True)
    (output / "model.safetensors").write_text("weights")
    assert discard_checkpoints(output) is False
    ckpt = checkpoints_dir(output) / "checkpoint-4"
    ckpt.mkdir(parents=True)
    (ckpt / "optimizer.pt").write_text("state")
    assert discard_checkpoints(output) is True
    assert not checkpoints_dir(output).exists()
    assert (output / "model.safetensors").read_text() == "weights"  # the output is not touched
    assert discard_checkpoints(output) is False


@dataclasses.dataclass(frozen=True)
class _Result:
    stage: str
    output_dir: Path
    metrics: dict[str, float]


def test_write_result_leaves_a_readable_sorted_json_of_the_dataclass(tmp_path):
    write_result(tmp_path, _Result("sft", tmp_path / "out", {"loss": 0.5, "epoch": 1.0}))
    text = (tmp_path / RESULT_FILE).read_text()
    data = json.loads(text)
    assert data == {
        "stage": "sft",
        "output_dir": str(tmp_path / "out"),
        "metrics": {"loss": 0.5, "epoch": 1.0},
    }
    assert list(data) == sorted(data) and list(data["metrics"]) == ["epoch", "loss"]  # stable, diffable
    assert len(text.splitlines()) > 3  # one field per line, for a person reading the store


def test_discard_checkpoints_is_best_effort_a_file_that_will_not_go_does_not_fail_the_step(
    tmp_path, monkeypatch
):
    """The output is already in place when checkpoints are discarded: a stuck file (another process holding
    it, a read-only mount) must not turn a finished step into a failure."""
    import os

    output = tmp_path / "stages" / "sft-0123456789ab"
    ckpt = checkpoints_dir(output) / "checkpoint-2"
    ckpt.mkdir(parents=True)
    (ckpt / "optimizer.pt").write_text("state")
    (ckpt / "model.safetensors").write_text("weights")
    unlink = os.unlink

    def stuck(path, *args, **kwargs):
        if str(path).endswith("optimizer.pt"):
            raise PermissionError(13, "Permission denied", str(path))
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", stuck)
    assert discard_checkpoints(output) is True
    assert not (ckpt / "model.safetensors").exists()  # what could go, went
    assert (ckpt / "optimizer.pt").exists()
