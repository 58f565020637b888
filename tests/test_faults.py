"""Faults as a user (or an attacker) meets them, in real `posttrain` processes: planted secrets,
unreachable servers on loopback ports with nothing listening, and what a run leaves behind."""

from __future__ import annotations

import os
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

SECRET = "PLANTEDSECRET0451"
BIN = Path(sys.executable).parent


def posttrain(args: list[str], cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """`posttrain ARGS` as a fresh process: its own embedded Prefect inside the store, no user servers."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    base.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_WAIT_POLICY="PASSIVE", **env)
    return subprocess.run(
        [str(BIN / "posttrain"), *args], cwd=cwd, env=base, capture_output=True, text=True, timeout=timeout
    )


def closed_port() -> int:
    """A loopback port with nothing listening (bound, released, not reused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def files_containing(root: Path, needle: bytes, skip: set[Path] = frozenset()) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p not in skip and needle in p.read_bytes()]


@pytest.fixture(scope="module")
def secret_run(tmp_path_factory):
    """A whole run whose config holds a secret in a custom reward's params and a URI password."""
    tmp = tmp_path_factory.mktemp("secret")
    (tmp / "secret_reward_mod.py").write_text(
        "def make_reward(api_key, **_):\n"
        "    def api_reward(completions, **kwargs):\n"
        "        return [float(i % 2) for i in range(len(completions))]\n"
        "    return api_reward\n"
    )
    cfg = tmp / "my_cfg.yaml"  # an underscore in the name: Prefect's artifact keys refuse it raw
    cfg.write_text(
        "model: {name: tiny-random, precision: fp32}\n"
        "data:\n  source: synthetic\n  synthetic: {num_examples: 32}\n  eval_size: 4\n"
        f"  max_prompt_tokens: 1024\n  hub_id: 'https://bob:{SECRET}@hub.example/x'\n"
        "grpo:\n  stages:\n    - name: s\n      rewards:\n"
        f"        - {{name: 'secret_reward_mod:make_reward', params: {{api_key: {SECRET}}}}}\n"
        "        - {name: xml_count}\n"
        "      trainer: {max_steps: 1, num_generations: 2, per_device_train_batch_size: 2, max_completion_length: 8}\n"
        "eval: {limit: 2, max_new_tokens: 4, batch_size: 2}\n"
        "tracking: {log_model: false}\n"
    )
    done = posttrain(
        ["run", str(cfg), "--allow-custom-code", "--set", f"model.cache_dir={tmp / 'models'}"],
        cwd=tmp,
        PYTHONPATH=str(tmp),
    )
    return tmp, cfg, done


def test_a_run_with_secrets_in_its_config_writes_them_nowhere(secret_run):
    tmp, cfg, done = secret_run
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr
    assert SECRET not in done.stdout and SECRET not in done.stderr
    assert (tmp / "mlflow.db").is_file() and list((tmp / ".posttrain" / "prefect").rglob("*.db"))
    # MLflow's database and artifacts, the store (outputs, records, Prefect's database with the
    # flow-run parameters): nothing but the config itself holds the secret.
    assert files_containing(tmp, SECRET.encode(), skip={cfg}) == []
    db = sqlite3.connect(tmp / "mlflow.db")
    params = dict(
        db.execute("select key, value from params where key like '%api_key%' or key like '%hub_id%'")
    )
    assert set(params.values()) <= {"***", "https://bob:***@hub.example/x"} and len(params) >= 2


def test_a_finished_run_leaves_no_mlflow_run_running(secret_run):
    tmp, _, _ = secret_run
    db = sqlite3.connect(tmp / "mlflow.db")
    statuses = {status for (status,) in db.execute("select status from runs")}
    assert statuses == {"FINISHED"}


@pytest.mark.parametrize("server", ["MLFLOW_TRACKING_URI", "PREFECT_API_URL"])
def test_an_unreachable_server_is_one_line_before_the_store_is_touched(server, tmp_path):
    """Loopback ports with nothing listening: the process exits 2 in one line, without having
    created the store, taken its lock or started Prefect's embedded server."""
    url = f"http://127.0.0.1:{closed_port()}" + ("/api" if server == "PREFECT_API_URL" else "")
    smoke = Path(__file__).resolve().parents[1] / "configs" / "smoke.yaml"
    start = time.monotonic()
    done = posttrain(
        ["run", str(smoke), "--set", f"orchestration.store={tmp_path / 'store'}"],
        cwd=tmp_path,
        **{server: url},
    )
    elapsed = time.monotonic() - start
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and f"{server}={url}" in done.stderr and "unreachable" in done.stderr
    assert not (tmp_path / "store").exists() and not (tmp_path / "mlflow.db").exists()
    assert elapsed < 120  # process start and config validation included; the probe itself is seconds


def test_runs_a_killed_run_left_running_are_closed_by_the_next_run_on_its_store(tmp_path, monkeypatch):
    """A SIGKILL leaves MLflow runs RUNNING forever; the next run holding the store's lock marks
    them KILLED. Another store's runs in the same tracking database are not touched (in-process)."""
    import mlflow

    from posttrain.flows.pipeline import posttrain_pipeline
    from posttrain.pipeline import load_config
    from posttrain.tracking.mlflow_io import STORE_TAG

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(
        "model: {name: tiny-random, precision: fp32}\n"
        "data: {source: synthetic, synthetic: {num_examples: 16}, eval_size: 2, max_prompt_tokens: 1024}\n"
        "eval: {limit: 1, max_new_tokens: 2, batch_size: 1}\n"
        f"tracking: {{tracking_uri: '{uri}', log_model: false}}\n"
        f"orchestration: {{store: {tmp_path / 'store'}}}\n"
    )
    cfg = load_config(cfg_file, [f"model.cache_dir={tmp_path / 'models'}"])
    client = mlflow.MlflowClient(uri)
    experiment = client.create_experiment("tiny", artifact_location=(tmp_path / "mlruns").as_uri())
    mine = client.create_run(experiment, tags={STORE_TAG: str((tmp_path / "store").resolve())})
    child = client.create_run(experiment, tags={"mlflow.parentRunId": mine.info.run_id})
    other = client.create_run(experiment, tags={STORE_TAG: str(tmp_path / "other-store")})  # alive elsewhere

    summary = posttrain_pipeline(cfg)

    def status(run):
        return client.get_run(run.info.run_id).info.status

    assert (status(mine), status(child), status(other)) == ("KILLED", "KILLED", "RUNNING")
    assert client.get_run(summary["run_id"]).info.status == "FINISHED"
