"""A team's MLflow: `mlflow server` on PostgreSQL (started here, tests/servers.py), as docs/scaling.md
sets it up. The smoke pipeline logs everything there, two pipelines write one experiment at once
(on PostgreSQL and on SQLite), and a server that goes away mid-run loses no training: the run ends
in one line, and the same command logs what is missing once the server is back."""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
from servers import BIN, MlflowServer, running, server_env

pytestmark = pytest.mark.servers

REPO = Path(__file__).resolve().parents[2]
SMOKE = REPO / "configs" / "smoke.yaml"
TRAINING = ["sft", "dpo", "grpo-format", "grpo-correctness"]
STEPS = ["data", "eval-baseline", "sft", "eval-sft", "dpo", "eval-dpo", "grpo-format", "eval-grpo-format"]
STEPS += ["grpo-correctness", "eval-grpo-correctness"]


def posttrain(
    args: list[str], cwd: Path, env: dict[str, str], timeout: float = 900
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "posttrain"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def places(tmp: Path, store: str = "store") -> list[str]:
    return ["--set", f"orchestration.store={tmp / store}", "--set", f"model.cache_dir={tmp / 'models'}"]


def client(uri: str):
    import mlflow

    return mlflow.MlflowClient(uri)


def runs_of(uri: str, experiment: str) -> list:
    mlflow_client = client(uri)
    found = mlflow_client.get_experiment_by_name(experiment)
    return mlflow_client.search_runs([found.experiment_id], max_results=1000) if found else []


def pipeline_runs(runs: list) -> list:
    return [r for r in runs if r.data.tags.get("posttrain.role") == "pipeline"]


def children(runs: list, parent_id: str) -> dict:
    return {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent_id}


@pytest.fixture(scope="module")
def team_server(postgres, tmp_path_factory):
    """`mlflow server --backend-store-uri postgresql://...` with a local artifact destination."""
    tmp = tmp_path_factory.mktemp("team-mlflow")
    backend = postgres.create_database("mlflow_team")
    with running(MlflowServer(tmp, backend=backend)) as server:
        yield server


def pg_count(postgres, database: str, table: str) -> int:
    import psycopg

    with psycopg.connect(
        host="127.0.0.1", port=postgres.port, user=postgres.user, password=postgres.password, dbname=database
    ) as conn:
        return conn.execute(f"select count(*) from {table}").fetchone()[0]


def test_the_smoke_pipeline_logs_everything_to_an_mlflow_server_on_postgresql(
    team_server, postgres, tmp_path
):
    """Parent and nested runs, tables, LoggedModels and system metrics land in PostgreSQL through the
    server; `compare --promote` works against it; a cached rerun finds the producers' runs. Nothing
    is written to a local tracking file (the default `sqlite:///mlflow.db` of a run that ignored
    the server)."""
    env = {**server_env(tmp_path), "MLFLOW_TRACKING_URI": team_server.uri}
    env["MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL"] = "0.5"  # a sample within each short stage
    first = posttrain(["run", str(SMOKE), *places(tmp_path)], tmp_path, env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "mlruns").exists()
    runs = runs_of(team_server.uri, "smoke")
    (parent,) = pipeline_runs(runs)
    nested = children(runs, parent.info.run_id)
    assert parent.info.status == "FINISHED" and set(nested) == set(STEPS)
    assert {r.info.status for r in nested.values()} == {"FINISHED"}
    mlflow_client = client(team_server.uri)
    # the rows are in PostgreSQL, not in a file beside the server
    assert pg_count(postgres, "mlflow_team", "runs") >= len(STEPS) + 1
    assert pg_count(postgres, "mlflow_team", "logged_models") >= len(TRAINING)
    evaluated = {a.path for a in mlflow_client.list_artifacts(nested["eval-sft"].info.run_id)}
    assert "eval_examples.json" in evaluated, evaluated
    assert "stage.json" in {a.path for a in mlflow_client.list_artifacts(nested["grpo-format"].info.run_id)}
    models = mlflow_client.search_logged_models(
        [parent.info.experiment_id],
        filter_string=f"tags.`posttrain.pipeline_run_id` = '{parent.info.run_id}'",
    )
    assert sorted(m.name for m in models) == sorted(TRAINING)
    assert {str(m.status) for m in models} == {"READY"}
    assert "system/cpu_utilization_percentage" in nested["grpo-format"].data.metrics

    compared = posttrain(
        ["compare", "--experiment", "smoke", "--last", "1", "--promote", "--metric", "strict_format_rate"],
        tmp_path,
        env,
    )
    assert compared.returncode == 0, compared.stderr[-3000:]
    assert parent.info.run_id[:12] in compared.stdout
    champion = mlflow_client.get_model_version_by_alias("smoke", "champion")
    promoted = mlflow_client.get_logged_model(champion.source.removeprefix("models:/"))
    assert promoted.model_id in {m.model_id for m in models}
    assert f"champion: smoke v{champion.version} = {promoted.name}" in compared.stdout

    again = posttrain(["run", str(SMOKE), *places(tmp_path)], tmp_path, env)
    assert again.returncode == 0, again.stderr[-3000:]
    runs = runs_of(team_server.uri, "smoke")
    (rerun,) = [r for r in pipeline_runs(runs) if r.info.run_id != parent.info.run_id]
    cached = children(runs, rerun.info.run_id)
    assert {name: r.data.tags.get("cached_from_run_id") for name, r in cached.items()} == {
        name: r.info.run_id for name, r in nested.items()
    }
    assert rerun.info.status == "FINISHED"


TWO_STAGES = ["--set", "dpo=null", "--set", "grpo.stages=[]", "--set", "tracking.experiment=team"]


@pytest.mark.parametrize("backend", ["postgresql", "sqlite"])
def test_two_pipelines_write_one_experiment_at_once(backend, team_server, tmp_path):
    """Two runs started together on two stores, one experiment: on the PostgreSQL-backed server,
    and on one SQLite file (MLflow's laptop store, written by both processes directly). Both
    finish, every run ends FINISHED, `compare` shows both, and `--promote` names one real version."""
    env = server_env(tmp_path)
    if backend == "postgresql":
        env["MLFLOW_TRACKING_URI"] = uri = team_server.uri
    else:
        uri = f"sqlite:///{tmp_path / 'team.db'}"
        env["MLFLOW_TRACKING_URI"] = uri
    procs = []
    for seed in (0, 1):
        args = ["run", str(SMOKE), *places(tmp_path, f"store-{seed}"), *TWO_STAGES, "--set", f"seed={seed}"]
        log = (tmp_path / f"run-{seed}.log").open("w")
        procs.append(
            subprocess.Popen([str(BIN / "posttrain"), *args], cwd=tmp_path, env=env, stdout=log, stderr=log)
        )
    for seed, proc in enumerate(procs):
        assert proc.wait(timeout=900) == 0, (tmp_path / f"run-{seed}.log").read_text()[-3000:]
    runs = runs_of(uri, "team")
    parents = pipeline_runs(runs)
    assert len(parents) == 2 and {r.info.status for r in runs} == {"FINISHED"}
    for parent in parents:
        assert set(children(runs, parent.info.run_id)) == {"data", "eval-baseline", "sft", "eval-sft"}
    compared = posttrain(
        ["compare", "--experiment", "team", "--last", "2", "--promote", "--metric", "strict_format_rate",
         "--registered-model", f"team-{backend}"],
        tmp_path, env,
    )  # fmt: skip
    assert compared.returncode == 0, compared.stderr[-3000:]
    assert all(p.info.run_id[:12] in compared.stdout for p in parents)
    mlflow_client = client(uri)
    champion = mlflow_client.get_model_version_by_alias(f"team-{backend}", "champion")
    model = mlflow_client.get_logged_model(champion.source.removeprefix("models:/"))
    assert model.name == "sft" and model.tags["posttrain.pipeline_run_id"] in {p.info.run_id for p in parents}
    versions = mlflow_client.search_model_versions(f"name = 'team-{backend}'")
    assert [v.version for v in versions] == [champion.version]


def test_a_tracking_server_that_goes_away_mid_run_loses_no_training(postgres, tmp_path):
    """The server stops while SFT trains. The pipeline trains every stage anyway and ends with one
    line naming the server and what to do; every step is in the store. Once the server is back, the
    same command runs no step and logs each one from the store: no run is left RUNNING."""
    server = MlflowServer(tmp_path / "server", backend=postgres.create_database("mlflow_outage"))
    server.folder.mkdir()
    server.start()
    try:
        # MLflow's own retry budget (minutes by default) cut short, as a team sets it for a flaky link
        env = {
            **server_env(tmp_path),
            "MLFLOW_TRACKING_URI": server.uri,
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1",
        }
        command = ["run", str(SMOKE), *places(tmp_path), "--set", "sft.trainer.max_steps=30"]
        log, err = tmp_path / "first.log", tmp_path / "first.err"
        with log.open("w") as out, err.open("w") as errors_out:
            proc = subprocess.Popen(
                [str(BIN / "posttrain"), *command], cwd=tmp_path, env=env, stdout=out, stderr=errors_out
            )
        deadline = time.monotonic() + 600
        while "[sft] starting" not in err.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
            time.sleep(0.2)
        time.sleep(2)  # inside SFT's steps: the trainer's callback is logging to the server
        server.stop()
        assert proc.wait(timeout=900) == 1, err.read_text()[-3000:]
        stderr = err.read_text()
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and stderr.rstrip().endswith(errors[0]), stderr[-3000:]
        assert re.search(rf"MLflow tracking at {re.escape(server.uri)} went away", errors[0])
        assert "run the same command again" in errors[0] and str(tmp_path / "store") in errors[0]
        # said once, while SFT trained: not a failed batch per logging step until the end
        assert stderr.count("went away during sft") == 1, stderr[-3000:]
        assert stderr.count("Failed to log run data") <= 1, stderr[-3000:]

        planned = posttrain(["run", str(SMOKE), *places(tmp_path), "--set", "sft.trainer.max_steps=30", "--dry-run"],
                            tmp_path, env)  # fmt: skip
        assert planned.returncode == 0 and planned.stdout.count(" cached ") == len(STEPS), planned.stdout

        server.start()  # the same port and database
        again = posttrain(command, tmp_path, env)
        assert again.returncode == 0, again.stderr[-3000:]
        statuses = re.findall(r"^(\S+)\s+(cached|ran)\s", again.stdout, re.M)
        assert dict(statuses) == dict.fromkeys(STEPS, "cached"), again.stdout
        runs = runs_of(server.uri, "smoke")
        assert "RUNNING" not in {r.info.status for r in runs}
        complete = [r for r in pipeline_runs(runs) if r.info.status == "FINISHED"]
        assert len(complete) == 1
        nested = children(runs, complete[0].info.run_id)
        assert set(nested) == set(STEPS) and {r.info.status for r in nested.values()} == {"FINISHED"}
        # what the lost run never logged, logged from the store: curves, evaluations, models
        assert nested["sft"].data.tags.get("logged_from_store") == "true"
        history = client(server.uri).get_metric_history(nested["sft"].info.run_id, "loss")
        assert len(history) >= 2
        assert "eval/accuracy_strict" in nested["eval-grpo-correctness"].data.metrics
        assert any(k.startswith("rewards/") for k in nested["grpo-format"].data.metrics)
        models = client(server.uri).search_logged_models(
            [complete[0].info.experiment_id],
            filter_string=f"tags.`posttrain.pipeline_run_id` = '{complete[0].info.run_id}'",
        )
        assert sorted(m.name for m in models) == sorted(TRAINING)
    finally:
        server.stop()
