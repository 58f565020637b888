"""Faults as a user (or an attacker) meets them, in real `posttrain` processes: planted secrets,
unreachable servers on loopback ports with nothing listening, runs killed with SIGKILL in each kind
of stage and rerun, concurrent runs, and what a run leaves behind."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from posttrain.training.stage_run import last_checkpoint

SECRET = "PLANTEDSECRET0451"
BIN = Path(sys.executable).parent


def clean_env(**env: str) -> dict[str, str]:
    """The environment of a fresh `posttrain`: its own embedded Prefect inside the store, no user servers."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    base.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_WAIT_POLICY="PASSIVE", **env)
    return base


def posttrain(args: list[str], cwd: Path, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """`posttrain ARGS` as a fresh process, run to its end."""
    return subprocess.run(
        [str(BIN / "posttrain"), *args],
        cwd=cwd,
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_posttrain(
    args: list[str], cwd: Path, log: Path, *, as_terminal: bool = False, **env: str
) -> subprocess.Popen:
    """`posttrain ARGS` started in the background, its output (both streams) in ``log``.

    ``as_terminal``: as a terminal starts it, the leader of its own process group (Ctrl-C signals
    the group) with SIGINT at its default: a shell starts its background jobs with SIGINT ignored
    (so may whatever started this suite), and a child inherits that."""
    terminal = {
        "start_new_session": True,
        "preexec_fn": lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    }
    with log.open("w") as out:
        return subprocess.Popen(
            [str(BIN / "posttrain"), *args],
            cwd=cwd,
            env=clean_env(**env),
            stdout=out,
            stderr=out,
            **(terminal if as_terminal else {}),
        )


def wait_for(condition, proc: subprocess.Popen, log: Path, timeout: float = 1200):
    """Poll ``condition()`` until it returns something truthy; fail if ``proc`` ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if found := condition():
            return found
        if proc.poll() is not None:
            pytest.fail(f"posttrain exited ({proc.returncode}) first:\n{log.read_text()[-3000:]}")
        time.sleep(0.02)
    proc.kill()
    pytest.fail(f"timed out:\n{log.read_text()[-3000:]}")


def all_gone(processes: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of ``processes`` still alive after ``timeout`` seconds (zombies count as gone)."""
    deadline = time.monotonic() + timeout
    alive = processes
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    return alive


def closed_port() -> int:
    """A loopback port with nothing listening (bound, released, not reused at once)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def files_containing(root: Path, needle: bytes, skip: set[Path] = frozenset()) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and p not in skip and needle in p.read_bytes()]


@pytest.mark.parametrize("server", ["MLFLOW_TRACKING_URI", "PREFECT_API_URL"])
def test_an_unreachable_server_is_one_line_before_the_store_is_touched(smoke_config_path, server, tmp_path):
    """Loopback ports with nothing listening: the process exits 2 in one line, without having
    created the store, taken its lock or started Prefect's embedded server."""
    url = f"http://127.0.0.1:{closed_port()}" + ("/api" if server == "PREFECT_API_URL" else "")
    smoke = smoke_config_path
    done = posttrain(
        ["run", str(smoke), "--set", f"orchestration.store={tmp_path / 'store'}"],
        cwd=tmp_path,
        **{server: url},
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.count("\n") == 1 and f"{server}={url}" in done.stderr and "unreachable" in done.stderr
    assert not (tmp_path / "store").exists() and not (tmp_path / "mlflow.db").exists()


def test_runs_a_killed_run_left_running_are_closed_by_the_next_run_on_its_store(tmp_path, monkeypatch):
    """A SIGKILL leaves MLflow runs RUNNING forever; the next run holding the store's lock marks
    them KILLED. Another store's runs in the same tracking database are not touched (in-process)."""
    import mlflow

    from posttrain.flows.pipeline_flow import posttrain_pipeline
    from posttrain.pipeline import load_config
    from posttrain.tracking.mlflow_io import STORE_TAG

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg_file = tmp_path / "tiny.yaml"
    cfg_file.write_text(
        "model: {name: tiny-random, precision: fp32}\n"
        "data: {source: synthetic, synthetic: {num_examples: 16}, eval_size: 2, max_prompt_tokens: 1024}\n"
        "eval: {limit: 1, max_completion_length: 2, batch_size: 1}\n"
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


# --------------------------------------------------------------------------- killed and resumed

MAX_STEPS = 6
KILL_AT = 2
KILLED_PIPELINE = f"""\
model: {{name: tiny-random, precision: fp32, lora: {{r: 4, alpha: 8}}}}
data:
  source: synthetic
  synthetic: {{num_examples: 32}}
  eval_size: 2
  max_prompt_tokens: 1024
  hub_id: 'https://bob:{SECRET}@hub.example/x'
sft: {{limit: 16, trainer: {{max_steps: {MAX_STEPS}, per_device_train_batch_size: 2, save_steps: 1}}}}
dpo:
  num_prompts: 4
  num_generations: 2
  max_completion_length: 8
  trainer: {{max_steps: {MAX_STEPS}, per_device_train_batch_size: 1, max_length: 256, save_steps: 1}}
grpo:
  stages:
    - name: s
      rewards:
        - {{name: 'secret_reward_mod:make_reward', params: {{api_key: {SECRET}}}}}
        - {{name: xml_count}}
      trainer: {{max_steps: {MAX_STEPS}, num_generations: 2, per_device_train_batch_size: 2,
                max_completion_length: 8, save_steps: 1}}
eval: {{baseline: false, after_each_stage: false, limit: 1, max_completion_length: 2, batch_size: 1}}
tracking: {{log_model: false}}
"""


def checkpoint_step(stages: Path, stage: str) -> int:
    """The step of the newest complete checkpoint of ``stage`` in the store (0: none)."""
    found = [last_checkpoint(folder) for folder in stages.glob(f"{stage}-*.ckpt")]
    return max((f[1] for f in found if f is not None), default=0)


def kill_during(stage: str, cmd: list[str], tmp: Path, log: Path, before_kill=None, **env: str) -> int:
    """Start a run, SIGKILL it once ``stage`` has a checkpoint of step KILL_AT or later (only the
    posttrain process: its Prefect server must follow by itself) and return the step of the newest
    complete checkpoint left on disk."""
    proc = start_posttrain(cmd, tmp, log, **env)
    if before_kill is not None:
        before_kill(proc)
    stages = tmp / ".posttrain" / "stages"
    wait_for(lambda: checkpoint_step(stages, stage) >= KILL_AT, proc, log)
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert any("uvicorn" in " ".join(c.cmdline()) for c in children if c.is_running()), "no Prefect server?"
    assert all_gone(children, timeout=10) == [], "the embedded Prefect server outlived its parent"
    left = checkpoint_step(stages, stage)
    assert KILL_AT <= left < MAX_STEPS, f"killed at {left}: not in the middle of {stage}"
    return left


def second_run_on_the_same_store_is_refused(cmd: list[str], tmp: Path, **env: str):
    """While the first run holds the store (frozen with SIGSTOP, so it cannot finish meanwhile),
    a second run on the same store exits 2 at once, naming the holder."""

    def check(first: subprocess.Popen) -> None:
        lock = tmp / ".posttrain" / "lock"
        wait_for(lambda: lock.exists() and lock.read_text().strip() == str(first.pid), first, tmp / "a.log")
        first.send_signal(signal.SIGSTOP)
        try:
            second = posttrain(cmd, tmp, timeout=300, **env)
        finally:
            first.send_signal(signal.SIGCONT)
        assert second.returncode == 2, second.stderr[-2000:]
        assert second.stderr.strip().splitlines() == [
            f"error: {cmd[1]}: orchestration.store: {(tmp / '.posttrain').resolve()} is in use by another "
            f"posttrain run (pid {first.pid})"
        ]

    return check


def records_of(store: Path, step: str) -> list[Path]:
    return [
        p for p in (store / "results").iterdir() if p.is_file() and json.loads(p.read_text())["step"] == step
    ]


def test_runs_killed_in_each_kind_of_stage_resume_to_the_exact_step_count_and_write_no_secret(tmp_path):
    """The config holds a secret in a custom reward's params and a URI password: through four runs,
    three of them killed, no output, log, database or artifact holds it."""
    tmp = tmp_path
    cfg = (
        tmp / "killed_run.yaml"
    )  # no `name:`, an underscore in the file's: Prefect's artifact keys refuse it raw
    cfg.write_text(KILLED_PIPELINE)
    (tmp / "secret_reward_mod.py").write_text(
        "def make_reward(api_key, **_):\n"
        "    def api_reward(completions, **kwargs):\n"
        "        return [float(i % 2) for i in range(len(completions))]\n"
        "    return api_reward\n"
    )
    cmd = ["run", cfg.name, "--allow-custom-code", "--set", f"model.cache_dir={tmp / 'models'}"]
    env = {"PYTHONPATH": str(tmp)}
    store = tmp / ".posttrain"
    logs = {name: tmp / f"{name}.log" for name in "abcd"}

    # a: killed during SFT (and, before that, a second run on the same store is refused); b: SFT
    # resumes and finishes, killed during DPO; c: DPO resumes, killed during GRPO; d: GRPO resumes.
    refused = second_run_on_the_same_store_is_refused(cmd, tmp, **env)
    left = {"sft": kill_during("sft", cmd, tmp, logs["a"], refused, **env)}
    left["dpo"] = kill_during("dpo", cmd, tmp, logs["b"], **env)
    left["grpo-s"] = kill_during("grpo-s", cmd, tmp, logs["c"], **env)
    # A kill between an output's rename and its cache record: the record is missing. The SFT output
    # is intact (adopted); the data output was damaged too (recomputed).
    for record in records_of(store, "sft") + records_of(store, "data"):
        record.unlink()
    stats = next((store / "data").glob("*/stats.json"))
    stats.write_text(stats.read_text() + " ")
    done = posttrain(cmd, tmp, **env)
    logs["d"].write_text(done.stdout + done.stderr)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Traceback" not in done.stderr

    for stage, log in (("sft", "b"), ("dpo", "c"), ("grpo-s", "d")):
        assert f"[{stage}] resuming from step {left[stage]} " in logs[log].read_text(), stage
        (out,) = (store / "stages").glob(f"{stage}-*[0-9a-f]")
        info = json.loads((out / "stage.json").read_text())
        assert info["metrics"]["global_step"] == MAX_STEPS, stage
        assert info["metrics"]["resumed_from_step"] == left[stage], stage
        history = [json.loads(line) for line in (out / "log_history.jsonl").read_text().splitlines()]
        assert [row["step"] for row in history if "loss" in row] == list(range(1, MAX_STEPS + 1)), stage
    assert "DPO: resuming on the" in logs["c"].read_text()
    assert re.search(r"sft\s+cached\s+complete output adopted", done.stderr)
    assert re.search(r"data\s+run\s+output without a cache record failed verification", done.stderr)
    assert len(records_of(store, "sft")) == 1 and len(records_of(store, "data")) == 1
    assert list((store / "stages").glob("*.ckpt")) == []  # no checkpoints once every stage is done

    db = sqlite3.connect(tmp / "mlflow.db")
    statuses = [status for (status,) in db.execute("select status from runs")]
    # Each killed run left its parent run and the stage it was in RUNNING; the next run closed them.
    assert statuses.count("KILLED") == 6 and set(statuses) == {"FINISHED", "KILLED"}

    # MLflow's database and artifacts, the store (outputs, records, Prefect's database with the
    # flow-run parameters), every run's console: nothing but the config itself holds the secret.
    assert list((store / "prefect").rglob("*.db"))
    assert files_containing(tmp, SECRET.encode(), skip={cfg}) == []
    params = dict(
        db.execute("select key, value from params where key like '%api_key%' or key like '%hub_id%'")
    )
    assert set(params.values()) <= {"***", "https://bob:***@hub.example/x"} and len(params) >= 2


# --------------------------------------------------------------------------- Ctrl-C

INTERRUPTED_PIPELINE = """\
model: {name: tiny-random, precision: fp32, lora: {r: 4, alpha: 8}}
data: {source: synthetic, synthetic: {num_examples: 32}, eval_size: 2, max_prompt_tokens: 1024}
sft: {limit: 16, trainer: {max_steps: 5000, per_device_train_batch_size: 2, save_steps: 5}}
eval: {baseline: false, limit: 1, max_completion_length: 2, batch_size: 1}
tracking: {log_model: false}
"""


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_an_interrupted_run_ends_at_once_with_prefect_and_mlflow_told(tmp_path, how):
    """Ctrl-C signals the terminal's whole foreground process group (posttrain and everything it
    started); SIGTERM (`kill`, a scheduler, a container stop) posttrain alone. Either way the run
    ends at once without a traceback and says so in one line (Ctrl-C: exit 130, `interrupted`;
    SIGTERM: exit 143, `terminated`, once Prefect hands the signal back), its Prefect flow run is recorded as crashed (the embedded server outlives the
    signal long enough to hear it), its MLflow runs as KILLED, none left RUNNING or FAILED, and
    nothing it started lives on."""
    cfg = tmp_path / "interrupted.yaml"
    cfg.write_text(INTERRUPTED_PIPELINE)
    log = tmp_path / "run.log"
    cmd = ["run", cfg.name, "--set", f"model.cache_dir={tmp_path / 'models'}"]
    proc = start_posttrain(cmd, tmp_path, log, as_terminal=True)
    try:
        wait_for(lambda: checkpoint_step(tmp_path / ".posttrain" / "stages", "sft") >= 5, proc, log)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any("uvicorn" in " ".join(c.cmdline()) for c in children), "no Prefect server?"
        # Python drops a KeyboardInterrupt raised inside a weakref callback or __del__; a user
        # then presses Ctrl-C again.
        for _ in range(3):
            if how == "ctrl-c":
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
                break
        assert proc.returncode == (130 if how == "ctrl-c" else 143), log.read_text()[-3000:]
        assert all_gone(children, timeout=10) == [], "something the run started outlived it"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    # A dropped KeyboardInterrupt prints Python's "Exception ignored in" with its traceback.
    tracebacks = output.count("Traceback") - output.count("Exception ignored in")
    assert tracebacks == 0 and "Error logging to API" not in output, output[-3000:]
    assert output.rstrip().endswith("interrupted" if how == "ctrl-c" else "terminated"), output[-3000:]

    (prefect_db,) = (tmp_path / ".posttrain" / "prefect").rglob("*.db")
    states = [s for (s,) in sqlite3.connect(prefect_db).execute("select state_type from flow_run")]
    assert states == ["CRASHED"]
    db = sqlite3.connect(tmp_path / "mlflow.db")
    statuses = dict(db.execute("select name, status from runs"))
    assert statuses.pop("data") == "FINISHED" and statuses.pop("sft") == "KILLED", statuses
    assert list(statuses.values()) == ["KILLED"], statuses  # the pipeline's own run
