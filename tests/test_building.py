"""One model built at a time: transformers' loading patches torch for the whole process
(:mod:`posttrain.models.building`), so a model built in another thread meanwhile must wait; and no
MLflow flush while a stage trains (it shuts down the thread pools the trainer's logging uses)."""

from __future__ import annotations

import threading

from accelerate import init_empty_weights

from posttrain.models.building import building_models
from posttrain.models.tiny import build_tiny_model


def test_a_model_built_beside_another_build_waits_and_gets_real_weights(tmp_path):
    inside, leave = threading.Event(), threading.Event()

    def other_build():  # what from_pretrained does: modules made on the meta device, process-wide
        with building_models(), init_empty_weights():
            inside.set()
            leave.wait(30)

    other = threading.Thread(target=other_build)
    other.start()
    assert inside.wait(30)
    built: dict = {}
    tiny = threading.Thread(target=lambda: built.setdefault("dir", build_tiny_model(tmp_path / "tiny")))
    tiny.start()
    tiny.join(6.0)  # a tiny build takes 1-2 s: still running after 6 s means it waits
    waited = tiny.is_alive()  # still waiting for the other build to end
    leave.set()
    other.join(30)
    tiny.join(60)
    assert waited and "dir" in built

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(built["dir"])
    assert not any(p.is_meta for p in model.parameters())
    assert all(p.abs().sum() > 0 for p in model.parameters())


def test_an_mlflow_flush_waits_for_a_training_stage_to_end(monkeypatch):
    import mlflow

    from posttrain.models.building import one_trainer_at_a_time
    from posttrain.tracking.mlflow_io import flush_async_logging

    flushed, training = threading.Event(), threading.Event()
    overlapped: list[bool] = []
    monkeypatch.setattr(mlflow, "flush_async_logging", flushed.set)

    def train():
        with one_trainer_at_a_time("sft"):
            training.set()
            overlapped.append(flushed.wait(timeout=1.0))  # did a flush run during training?

    trainer = threading.Thread(target=train)
    trainer.start()
    assert training.wait(30)
    flush_async_logging()
    trainer.join(30)
    assert overlapped == [False] and flushed.is_set()
    with one_trainer_at_a_time("grpo"):  # reentrant: a flush from inside a training stage goes through
        flushed.clear()
        flush_async_logging()
        assert flushed.is_set()
