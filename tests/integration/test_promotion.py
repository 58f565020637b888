"""Stage models and the ``champion`` alias (tracking/logged_models.py) on a real MLflow SQLite store,
with LoggedModels made as a pipeline run makes them but without training anything
(tests/system/test_pipeline.py promotes through ``posttrain compare`` after a whole run)."""

from __future__ import annotations

import logging

import pytest

METRIC = "eval/accuracy_strict"


class Registry:
    """An MLflow store with one experiment and a parent (pipeline) run per :meth:`pipeline` call."""

    def __init__(self, tmp_path):
        import mlflow

        self.uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
        self.client = mlflow.MlflowClient(self.uri)
        self.experiment = self.client.create_experiment("cfg")

    def pipeline(self):
        return self.client.create_run(self.experiment, run_name="pipeline").info.run_id

    def model(self, parent, stage, value=None, *, ready=True, config="cfg", cache_key=None, metric=METRIC):
        """A stage run under ``parent`` and its LoggedModel, with ``metric`` logged against it."""
        import mlflow

        from posttrain.tracking.logged_models import MODEL_ID_TAG, create_stage_model
        from posttrain.tracking.mlflow_io import global_tracking_uri

        run = self.client.create_run(self.experiment, run_name=stage, tags={"mlflow.parentRunId": parent})
        model = create_stage_model(
            self.client,
            self.experiment,
            stage=stage,
            kind="sft",
            source_run_id=run.info.run_id,
            pipeline_run_id=parent,
            config_name=config,
            cache_key=cache_key,
        )
        if ready:
            self.client.finalize_logged_model(model.model_id, "READY")
        if value is not None:
            with global_tracking_uri(self.uri):
                mlflow.log_metrics(
                    {metric: value}, run_id=run.info.run_id, model_id=model.model_id, synchronous=True
                )
        self.client.set_tag(run.info.run_id, MODEL_ID_TAG, model.model_id)
        return model.model_id

    def candidates(self, *parents):
        from posttrain.tracking.logged_models import models_of_runs

        return models_of_runs(self.client, list(parents))

    def promote(self, *parents, **options):
        from posttrain.tracking.logged_models import promote_champion

        return promote_champion(self.uri, self.candidates(*parents), **options)

    def champion(self, name="cfg"):
        version = self.client.get_model_version_by_alias(name, "champion")
        return version.version, version.source.removeprefix("models:/")


@pytest.fixture
def registry(tmp_path):
    return Registry(tmp_path)


def test_stage_models_are_the_ready_stage_models_with_their_latest_metrics(registry):
    from posttrain.tracking.logged_models import stage_models

    parent = registry.pipeline()
    sft = registry.model(parent, "sft", 0.25)
    registry.model(parent, "dpo", 0.5, ready=False)  # still being written: not a candidate
    import mlflow

    from posttrain.tracking.mlflow_io import global_tracking_uri

    with global_tracking_uri(registry.uri):
        run_id = registry.client.get_logged_model(sft).source_run_id
        mlflow.log_metrics(
            {METRIC: 0.75}, run_id=run_id, model_id=sft, synchronous=True
        )  # a later evaluation
    [model] = stage_models(registry.client, [registry.experiment])
    assert (model.model_id, model.stage, model.config_name, model.pipeline_run_id) == (
        sft,
        "sft",
        "cfg",
        parent,
    )
    assert model.source_run_id == registry.client.get_logged_model(sft).source_run_id
    assert model.metrics == {METRIC: 0.75}


def test_models_of_runs_are_the_models_their_stage_runs_name(registry):
    first, second, other = registry.pipeline(), registry.pipeline(), registry.pipeline()
    a, b = registry.model(first, "sft", 0.1), registry.model(second, "dpo", 0.2)
    registry.model(other, "grpo", 0.9)
    assert sorted(m.model_id for m in registry.candidates(first, second)) == sorted([a, b])
    assert [m.model_id for m in registry.candidates(second)] == [b]
    assert registry.candidates() == []


def test_find_stage_model_is_the_newest_ready_one_of_a_cache_key(registry):
    from posttrain.tracking.logged_models import find_stage_model

    parent = registry.pipeline()
    older = registry.model(parent, "sft", cache_key="k1")
    newer = registry.model(parent, "sft", cache_key="k1")
    registry.model(parent, "sft", cache_key="k1", ready=False)
    registry.model(parent, "sft", cache_key="k2")
    assert find_stage_model(registry.client, [registry.experiment], "k1") == newer != older
    assert find_stage_model(registry.client, [registry.experiment], "k3") is None


def test_the_best_candidate_becomes_the_champion(registry, caplog):
    parent = registry.pipeline()
    registry.model(parent, "sft", 0.25)
    best = registry.model(parent, "dpo", 0.5)
    registry.model(parent, "grpo", None)  # not evaluated: not a candidate
    with caplog.at_level(logging.INFO, logger="posttrain.tracking.logged_models"):
        done = registry.promote(parent)
    assert (done.registered_model, done.metric, done.model.model_id, done.value) == ("cfg", METRIC, best, 0.5)
    assert (done.version, done.previous_version, done.previous_value, done.moved) == (1, None, None, True)
    assert done.message == (f"champion: cfg v1 = dpo of run {parent[:12]} ({METRIC} 0.5; no champion before)")
    assert caplog.messages == [done.message]
    assert registry.champion() == (1, best)
    version = registry.client.get_model_version("cfg", "1")
    assert version.tags == {
        "posttrain.stage": "dpo",
        "posttrain.promoted_on": METRIC,
        "posttrain.promoted_value": "0.5",
    }
    assert version.run_id == registry.client.get_logged_model(best).source_run_id


def test_the_champion_stays_when_it_is_already_the_best(registry):
    parent = registry.pipeline()
    best = registry.model(parent, "sft", 0.5)
    registry.promote(parent)
    again = registry.promote(parent)
    assert (again.moved, again.version, again.previous_version, again.previous_value) == (
        False,
        1,
        1,
        0.5,
    )
    assert again.message == f"champion unchanged: cfg v1 is already the best, sft ({METRIC} 0.5)"
    assert registry.champion() == (1, best)


def test_a_better_champion_is_kept_unless_forced(registry):
    first, second = registry.pipeline(), registry.pipeline()
    old = registry.model(first, "sft", 0.5)
    registry.promote(first)
    worse = registry.model(second, "dpo", 0.25)
    kept = registry.promote(second)
    assert (kept.moved, kept.version, kept.previous_value, kept.value) == (False, 1, 0.5, 0.25)
    assert kept.message == (
        f"champion kept: cfg v1 scores {METRIC} 0.5, above the best candidate dpo (0.25); "
        "pass --force to move it anyway"
    )
    assert registry.champion() == (1, old)
    forced = registry.promote(second, force=True)
    assert (forced.moved, forced.version, forced.previous_version, forced.previous_value) == (
        True,
        2,
        1,
        0.5,
    )
    assert forced.message.endswith(f"({METRIC} 0.25; was v1 at 0.5)")
    assert registry.champion() == (2, worse)
    # back to the first model: its version is reused, not registered again
    back = registry.promote(first, force=True)
    assert (back.version, back.previous_value) == (1, 0.25) and registry.champion() == (1, old)
    assert len(registry.client.search_model_versions("name = 'cfg'")) == 2


def test_a_better_candidate_moves_the_champion(registry):
    first, second = registry.pipeline(), registry.pipeline()
    registry.model(first, "sft", 0.25)
    registry.promote(first)
    better = registry.model(second, "grpo", 0.75)
    moved = registry.promote(second)  # the champion is not among these candidates: read from MLflow
    assert (moved.moved, moved.version, moved.previous_version, moved.previous_value) == (
        True,
        2,
        1,
        0.25,
    )
    assert registry.champion() == (2, better)


def test_a_champion_whose_model_is_gone_does_not_block_a_promotion(registry):
    first, second = registry.pipeline(), registry.pipeline()
    old = registry.model(first, "sft", 0.9)
    registry.promote(first)
    registry.client.delete_logged_model(old)
    new = registry.model(second, "dpo", 0.1)
    moved = registry.promote(second)
    assert (moved.moved, moved.previous_value) == (True, None) and moved.message.endswith("; was v1)")
    assert registry.champion() == (2, new)


def test_the_metric_may_be_named_with_or_without_its_prefix(registry):
    parent = registry.pipeline()
    registry.model(parent, "sft", 0.9)
    best = registry.model(parent, "dpo", 0.1, metric="eval/strict_format_rate")
    done = registry.promote(parent, metric="strict_format_rate")
    assert (done.metric, done.model.model_id) == ("eval/strict_format_rate", best)
    named = registry.promote(parent, metric="eval/accuracy_strict", registered_model="mine")
    assert named.registered_model == "mine" and registry.champion("mine")[0] == 1


def test_promotion_needs_the_metric_and_a_name(registry):
    parent = registry.pipeline()
    registry.model(parent, "sft", 0.5, config="")
    with pytest.raises(ValueError, match=r"^no stage model of these runs has the metric 'eval/nope'$"):
        registry.promote(parent, metric="nope")
    with pytest.raises(
        ValueError, match=r"^the best stage model has no config name: pass a registered model name$"
    ):
        registry.promote(parent)


def test_a_tie_goes_to_the_first_candidate_and_to_the_candidate_over_the_champion(registry):
    first, second = registry.pipeline(), registry.pipeline()
    registry.model(first, "sft", 0.5)
    registry.model(first, "dpo", 0.5)
    done = registry.promote(first)
    leader = registry.candidates(first)[0].model_id
    assert done.model.model_id == leader and registry.champion() == (1, leader)
    equal = registry.model(second, "grpo", 0.5)
    moved = registry.promote(second)  # only a champion that scores higher is kept
    assert (moved.moved, moved.previous_value) == (True, 0.5) and registry.champion() == (2, equal)


def test_what_a_kept_champion_reports(registry):
    first, second = registry.pipeline(), registry.pipeline()
    registry.model(first, "sft", 0.5)
    registry.promote(first)
    worse = registry.model(second, "dpo", 0.25)
    kept = registry.promote(second)
    assert (kept.registered_model, kept.metric, kept.model.model_id) == ("cfg", METRIC, worse)


def test_the_registered_model_and_its_versions_name_their_source(registry):
    import dataclasses

    from posttrain.tracking.logged_models import promote_champion

    parent = registry.pipeline()
    model_id = registry.model(parent, "sft", 0.5)
    [candidate] = registry.candidates(parent)
    done = promote_champion(registry.uri, [dataclasses.replace(candidate, pipeline_run_id=None)])
    assert done.message == f"champion: cfg v1 = sft of run ? ({METRIC} 0.5; no champion before)"
    assert registry.client.get_registered_model("cfg").tags == {"posttrain.config_name": "cfg"}
    version = registry.client.get_model_version("cfg", "1")
    assert version.run_id == candidate.source_run_id and version.source == f"models:/{model_id}"


def test_a_model_registered_under_another_name_gets_its_own_version(registry):
    first, second = registry.pipeline(), registry.pipeline()
    registry.model(first, "sft", 0.5)
    registry.promote(first, registered_model="other")
    better = registry.model(second, "dpo", 0.75)
    assert registry.promote(second, registered_model="other").version == 2  # other v2 = better
    assert registry.promote(second).version == 1  # cfg's first version, not other's
    assert registry.champion() == (1, better)


class _Versions:
    """A registry client whose new version is pending ``pending`` times (a remote registry)."""

    def __init__(self, pending: int):
        self.pending, self.calls = pending, 0

    def get_model_version(self, name, version):
        self.calls += 1
        status = "PENDING_REGISTRATION" if self.calls <= self.pending else "READY"
        return type("Version", (), {"status": status})()


def test_a_pending_version_is_waited_for_until_ready_or_the_timeout(monkeypatch):
    from posttrain.tracking import logged_models

    now = [0.0]
    slept = []

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    monkeypatch.setattr(logged_models.time, "sleep", sleep)
    monkeypatch.setattr(logged_models.time, "monotonic", lambda: now[0])
    client = _Versions(pending=3)
    logged_models._wait_ready(client, "cfg", "1")
    assert client.calls == 4 and slept == [0.2, 0.2, 0.2]
    slept.clear()
    forever = _Versions(pending=10**6)
    logged_models._wait_ready(forever, "cfg", "1", timeout=1.0)
    # five sleeps reach the deadline exactly; it gives up only once past it
    assert len(slept) == 6 and forever.calls == 7
