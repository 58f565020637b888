"""Against real servers on loopback: an `mlflow server` and a `prefect server start`, both started here.

`posttrain serve` registers a scheduled deployment; the test checks its cron schedule, triggers a
run, and checks that the run completes and that its MLflow runs landed on the tracking server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.servers

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


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


def test_serve_registers_a_cron_deployment_whose_triggered_run_completes(servers):
    env, tmp = servers
    serve = start(
        [
            str(BIN / "posttrain"),
            "serve",
            str(REPO / "configs" / "smoke.yaml"),
            "--cron",
            "0 3 * * *",
            "--name",
            "nightly",
            "--set",
            f"orchestration.store={tmp / 'store'}",
            "--set",
            f"model.cache_dir={tmp / 'models'}",
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
"""
