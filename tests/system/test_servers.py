"""Against real servers on loopback: an `mlflow server` and a `prefect server start`, both started here.

`posttrain serve` registers a scheduled deployment; the test checks its cron schedule, triggers a
run, and checks that the run completes and that its MLflow runs landed on the tracking server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from servers import prefect_cli, start, stop, wait_http

from posttrain.core.net import free_port

pytestmark = pytest.mark.servers

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("servers")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(
        PREFECT_HOME=str(tmp / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_LOGGING_LEVEL="WARNING",
    )
    mlflow_port, prefect_port = free_port(), free_port()
    procs = []
    try:
        procs.append(
            start(
                [
                    str(BIN / "mlflow"),
                    "server",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(mlflow_port),
                    "--backend-store-uri",
                    f"sqlite:///{tmp / 'mlflow-server.db'}",
                    "--artifacts-destination",
                    str(tmp / "artifacts"),
                    "--workers",
                    "1",
                ],
                env,
                tmp / "mlflow.log",
            )
        )
        procs.append(
            start(
                [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(prefect_port)],
                env,
                tmp / "prefect.log",
            )
        )
        wait_http(f"http://127.0.0.1:{mlflow_port}/health", procs[0])
        wait_http(f"http://127.0.0.1:{prefect_port}/api/health", procs[1])
        env.update(
            MLFLOW_TRACKING_URI=f"http://127.0.0.1:{mlflow_port}",
            PREFECT_API_URL=f"http://127.0.0.1:{prefect_port}/api",
        )
        yield env, tmp
    finally:
        for proc in reversed(procs):
            stop(proc)


def test_serve_registers_a_cron_deployment_whose_triggered_run_completes(smoke_config_path, servers):
    env, tmp = servers
    serve = start(
        [
            str(BIN / "posttrain"),
            "serve",
            str(smoke_config_path),
            "--cron",
            "0 3 * * *",
            "--name",
            "nightly",
            "--set",
            f"orchestration.store={tmp / 'store'}",
            "--set",
            f"model.cache_dir={tmp / 'models'}",
            # Every GRPO step's entropy is below this, so the stage raises a health alert for sure.
            "--set",
            "grpo.stages.0.monitor.min_entropy=1000",
        ],
        env,
        tmp / "serve.log",
    )
    try:
        result = subprocess.run(
            [sys.executable, "-c", TRIGGER], env=env, capture_output=True, text=True, timeout=600, cwd=tmp
        )
        assert result.returncode == 0, result.stderr[-3000:] + (tmp / "serve.log").read_text()[-3000:]
        lines = dict(line.split("=", 1) for line in result.stdout.strip().splitlines() if "=" in line)
        assert lines["cron"] == "0 3 * * *"
        assert lines["state"] == "COMPLETED", (tmp / "serve.log").read_text()[-3000:]
        # posttrain's own log lines are in the task runs' logs (what the Prefect UI shows per task)
        assert int(lines["posttrain_task_logs"]) >= 5, lines
        assert "[grpo-format] done in" in lines["grpo_format_logs"], lines
        # each health alert is a Prefect event an automation can act on, tied to the flow run
        assert "posttrain.health.entropy" in lines["event_names"].split(","), lines
        event = json.loads(lines["event"])
        assert event["resource"]["prefect.resource.id"] == "posttrain.stage.smoke.grpo-format"
        roles = {r["prefect.resource.role"]: r["prefect.resource.id"] for r in event["related"]}
        assert roles["flow-run"] == f"prefect.flow-run.{lines['flow_run']}" and "task-run" in roles
        assert event["payload"]["kind"] == "entropy" and event["payload"]["step"] == 1
    finally:
        stop(serve)

    import mlflow

    client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])
    experiment = client.get_experiment_by_name("smoke")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if r.data.tags.get("posttrain.role") == "pipeline"]
    assert len(parents) == 1 and parents[0].info.status == "FINISHED"
    assert len(runs) == 11  # the parent + data + 5 evaluations + 4 training stages


# Runs in a subprocess so this test process never binds Prefect's settings to the server.
TRIGGER = """
import time
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment

deadline = time.monotonic() + 120
with get_client(sync_client=True) as client:
    while True:
        try:
            deployment = client.read_deployment_by_name("posttrain-pipeline/nightly")
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    print("cron=" + deployment.schedules[0].schedule.cron)
run = run_deployment("posttrain-pipeline/nightly", timeout=480)
print("state=" + run.state.type.value)
print("flow_run=" + str(run.id))

import json, os, urllib.request
from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId, TaskRunFilter, TaskRunFilterFlowRunId

with get_client(sync_client=True) as client:
    logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])), limit=200)
    tasks = {t.id: t.name for t in client.read_task_runs(
        task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[run.id])))}
ours = [l for l in logs if l.name.startswith("posttrain") and l.task_run_id is not None]
print("posttrain_task_logs=" + str(len(ours)))
print("grpo_format_logs=" + " | ".join(l.message for l in ours if tasks.get(l.task_run_id) == "grpo-format"))

body = json.dumps({"filter": {"event": {"prefix": ["posttrain.health."]}}, "limit": 50}).encode()
request = urllib.request.Request(os.environ["PREFECT_API_URL"] + "/events/filter", data=body,
                                 headers={"Content-Type": "application/json"})
deadline = time.monotonic() + 60
while True:  # the server persists events asynchronously
    with urllib.request.urlopen(request, timeout=10) as response:
        events = json.loads(response.read())["events"]
    # the server persists events asynchronously: wait for the one looked for, not just any
    if any(e["event"] == "posttrain.health.entropy" for e in events) or time.monotonic() > deadline:
        break
    time.sleep(1)
print("event_names=" + ",".join(sorted({e["event"] for e in events})))
wanted = [e for e in events if e["event"] == "posttrain.health.entropy"]
print("event=" + json.dumps(min(wanted, key=lambda e: e["occurred"]) if wanted else {}))
"""


def test_a_process_work_pool_worker_runs_the_smoke_deployment_of_prefect_yaml(servers):
    """What prefect.yaml's header says, command by command: create the pool, `prefect deploy`,
    start a worker, trigger a run; the run completes and its MLflow runs are there."""
    import yaml

    env, tmp = servers
    env = {**env, "PREFECT_WORKER_QUERY_SECONDS": "1", "PREFECT_WORKER_PREFETCH_SECONDS": "1"}
    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    (smoke,) = [d for d in spec["deployments"] if d["name"] == "smoke"]
    pool = smoke["work_pool"]["name"]

    def prefect(*args: str) -> None:
        prefect_cli(env, *args, cwd=REPO)

    prefect("work-pool", "create", pool, "--type", "process")
    prefect("deploy", "--name", "smoke")
    # The Kubernetes GPU pool and its deployment, as prefect.yaml documents them: the server checks
    # the base job template and the deployment's job variables against it (no cluster needed).
    prefect(
        "work-pool",
        "create",
        "posttrain-k8s-gpu",
        "--type",
        "kubernetes",
        "--base-job-template",
        "configs/prefect/kubernetes-gpu-job-template.json",
    )
    env["POSTTRAIN_IMAGE"] = "registry.example.com/posttrain:test"
    prefect("deploy", "--name", "qwen-gsm8k-gpu")
    worker = start(
        [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--limit", "1"], env, tmp / "worker.log"
    )
    overrides = [
        f"orchestration.store={tmp / 'pool-store'}",
        f"tracking.tracking_uri=sqlite:///{tmp / 'pool-mlflow.db'}",
        f"model.cache_dir={tmp / 'models'}",
        "dpo=null",
        "grpo.stages=[]",
    ]
    try:
        result = subprocess.run(
            [
                sys.executable,
                "-c",
                RUN_DEPLOYMENT,
                json.dumps({"config": smoke["parameters"]["config"], "overrides": overrides}),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp,
        )
        log = (tmp / "worker.log").read_text()[-3000:]
        assert result.returncode == 0, result.stderr[-3000:] + log
        lines = dict(line.split("=", 1) for line in result.stdout.strip().splitlines() if "=" in line)
        assert lines["state"] == "COMPLETED", result.stdout[-2000:] + log
        gpu = json.loads(lines["gpu_job_variables"])
        assert (gpu["gpu"], gpu["image"]) == (1, "registry.example.com/posttrain:test")
    finally:
        stop(worker)

    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp / 'pool-mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("smoke").experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("posttrain.role") == "pipeline"]
    assert parent.info.status == "FINISHED"
    children = {r.info.run_name for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert children == {"data", "eval-baseline", "sft", "eval-sft"}


# In a subprocess, as TRIGGER: the deployment `prefect deploy` registered, run with these parameters.
RUN_DEPLOYMENT = """
import json, sys
from prefect.client.orchestration import get_client
from prefect.deployments import run_deployment

with get_client(sync_client=True) as client:
    gpu = client.read_deployment_by_name("posttrain-run-config/qwen-gsm8k-gpu")
print("gpu_job_variables=" + json.dumps(gpu.job_variables, sort_keys=True))
run = run_deployment("posttrain-run-config/smoke", parameters=json.loads(sys.argv[1]), timeout=480)
print("state=" + run.state.type.value)
"""
