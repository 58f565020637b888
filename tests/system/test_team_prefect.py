"""A team's Prefect: `prefect server start` on PostgreSQL (started here, tests/servers.py), a process
work pool and a worker, as docs/scaling.md sets them up. Two deployments triggered at once both
finish, their training and evaluation steps queueing for one `gpu` slot; a run survives its Prefect
server restarting in the middle of a stage."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from servers import BIN, PrefectServer, prefect_cli, running, start, stop

pytestmark = pytest.mark.servers

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def prefect_on_postgres(postgres, tmp_path, request):
    """A Prefect server of this test's own, on a fresh PostgreSQL database."""
    name = "prefect_" + request.node.name.split("[")[0][-40:].replace("-", "_")
    url = postgres.url(postgres.create_database(name).rsplit("/", 1)[1], driver="asyncpg")
    with running(PrefectServer(tmp_path / "prefect", database=url)) as server:
        yield server


def on_server(env: dict[str, str], script: str, *args: str, cwd: Path) -> dict[str, str]:
    """``script`` run against the server in a fresh interpreter (this process never binds Prefect's
    settings to it); its ``key=value`` lines."""
    done = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=900, cwd=cwd
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(line.split("=", 1) for line in done.stdout.strip().splitlines() if "=" in line)


def test_two_deployments_triggered_at_once_share_one_gpu_slot(prefect_on_postgres, tmp_path):
    """prefect.yaml's two CPU deployments, triggered together on two stores, run side by side in one
    process worker. With `orchestration.gpu_slots: 1` no two training or evaluation steps overlap:
    one run's steps stay Pending while the other's hold the slot, and both runs complete."""
    server = prefect_on_postgres
    env = {
        **server.env(),
        "PREFECT_API_URL": server.api_url,
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_WORKER_PREFETCH_SECONDS": "1",
    }
    prefect_cli(env, "work-pool", "create", "posttrain-local", "--type", "process", cwd=REPO)
    prefect_cli(env, "deploy", "--name", "smoke", cwd=REPO)
    prefect_cli(env, "deploy", "--name", "smollm2-gsm8k-cpu", cwd=REPO)
    worker = start(
        [str(BIN / "prefect"), "worker", "start", "--pool", "posttrain-local", "--limit", "2"],
        env,
        tmp_path / "worker.log",
    )
    parameters = {
        name: {
            "config": "configs/smoke.yaml",
            "overrides": [
                f"orchestration.store={tmp_path / name}",
                f"tracking.tracking_uri=sqlite:///{tmp_path / name}.db",
                f"model.cache_dir={tmp_path / 'models'}",
                "orchestration.gpu_slots=1",
                # long enough that the run which reaches SFT first holds the slot while the other,
                # started with it but a few seconds behind, asks for it
                "sft.trainer.max_steps=100",
                "dpo=null",
                "grpo.stages=[]",
            ],
        }
        for name in ("smoke", "smollm2-gsm8k-cpu")
    }
    try:
        lines = on_server(env, TRIGGER_BOTH, json.dumps(parameters), cwd=tmp_path)
    finally:
        stop(worker)
    log = (tmp_path / "worker.log").read_text()[-3000:]
    assert lines["states"] == "COMPLETED,COMPLETED", log
    tasks = json.loads(lines["gpu_tasks"])
    assert {t["name"] for t in tasks} >= {"eval-baseline", "sft", "eval-sft"}
    assert len({t["flow"] for t in tasks}) == 2  # both runs' steps took the slot
    spans = sorted((at(t["start"]), at(t["end"]), t["name"], t["flow"]) for t in tasks)
    for (_, end, name, _), (start_next, _, name_next, _) in zip(spans, spans[1:], strict=False):
        assert end <= start_next, f"{name} and {name_next} ran at once under gpu_slots: 1"
    # A step that waited: it was Pending (submitted) while a step of the other run held the slot.
    waited = [
        t["name"]
        for t in tasks
        for _, end, _, flow in spans
        if flow != t["flow"] and at(t["states"]["Pending"]) < end <= at(t["states"]["Running"])
    ]
    assert waited, json.dumps(tasks, indent=1)


def at(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp)


# Both deployments triggered without waiting, then waited for together.
TRIGGER_BOTH = """
import json, sys, time
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterTags
from prefect.deployments import run_deployment

parameters = json.loads(sys.argv[1])
runs = [run_deployment(f"posttrain-run-config/{name}", parameters=p, timeout=0) for name, p in parameters.items()]
with get_client(sync_client=True) as client:
    deadline = time.monotonic() + 800
    while True:
        states = [client.read_flow_run(r.id).state for r in runs]
        if all(s.is_final() for s in states) or time.monotonic() > deadline:
            break
        time.sleep(2)
    print("states=" + ",".join(s.type.value for s in states))
    gpu = client.read_task_runs(task_run_filter=TaskRunFilter(tags=TaskRunFilterTags(all_=["gpu"])))
    print("gpu_tasks=" + json.dumps([
        {"name": t.name, "flow": str(t.flow_run_id), "start": t.start_time.isoformat(),
         "end": t.end_time.isoformat(),
         "states": {s.name: s.timestamp.isoformat() for s in client.read_task_run_states(t.id)}}
        for t in gpu if t.start_time and t.end_time
    ]))
"""


def test_a_run_survives_its_prefect_server_restarting_mid_stage(prefect_on_postgres, tmp_path):
    """`posttrain run` with PREFECT_API_URL; the server stops while SFT trains and comes back on the
    same port and database. Prefect's client rides the gap out: the run finishes, and the server
    holds its flow run and every task run COMPLETED."""
    server = prefect_on_postgres
    env = {**server.env(), "PREFECT_API_URL": server.api_url}
    command = [
        str(BIN / "posttrain"), "run", str(REPO / "configs" / "smoke.yaml"),
        "--set", f"orchestration.store={tmp_path / 'store'}",
        "--set", f"tracking.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}",
        "--set", f"model.cache_dir={tmp_path / 'models'}",
        "--set", "sft.trainer.max_steps=30",
    ]  # fmt: skip
    err = tmp_path / "run.err"
    with err.open("w") as errors_out, (tmp_path / "run.log").open("w") as out:
        proc = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=errors_out)
    deadline = time.monotonic() + 600
    while "[sft] starting" not in err.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
        time.sleep(0.2)
    server.stop()
    time.sleep(5)
    server.start()
    assert proc.wait(timeout=900) == 0, err.read_text()[-3000:]
    lines = on_server(env, STATES_OF_ALL, cwd=tmp_path)
    assert lines["flow_runs"] == "posttrain-pipeline:COMPLETED", lines
    assert set(lines["task_states"].split(",")) == {"COMPLETED"}, lines
    assert int(lines["task_runs"]) == 10


STATES_OF_ALL = """
from prefect.client.orchestration import get_client

with get_client(sync_client=True) as client:
    flows = client.read_flow_runs()
    names = {f.id: client.read_flow(f.flow_id).name for f in flows}
    print("flow_runs=" + ",".join(f"{names[f.id]}:{f.state.type.value}" for f in flows))
    tasks = client.read_task_runs()
    print("task_runs=" + str(len(tasks)))
    print("task_states=" + ",".join(sorted({t.state.type.value for t in tasks})))
"""
