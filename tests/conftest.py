"""Shared fixtures: a tiny random causal LM built offline once per session, and isolated stores.

The suite is in three folders: ``unit/`` (pure functions, configs, keys, the plan: no trained model,
no pipeline run), ``integration/`` (the tiny model, stages, evaluation, the CLI in-process, one
store per module) and ``system/`` (servers, several processes, kills, whole pipeline runs, sweeps).
Every test under ``system/`` carries the ``system`` marker, so ``-m "not system"`` is the quick part.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# Tests never reach a hub; fail fast instead of waiting on timeouts.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Idle OpenMP threads spin-wait; on a loaded 2-core machine that makes each small op ~100x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Prefect: an isolated ephemeral API per test session, never a developer's configured server.
os.environ.pop("PREFECT_API_URL", None)
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="posttrain-prefect-")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")  # as the CLI sets it
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.pop("MLFLOW_TRACKING_URI", None)

REPO_ROOT = Path(__file__).resolve().parents[1]
GSM8K_TRAIN_VARIABLE = "POSTTRAIN_TEST_GSM8K_TRAIN"


def gsm8k_train_location(environ: dict[str, str]) -> Path:
    """Where the tests look for the real GSM8K train split: the file the variable names (a clone that
    does not sit beside ``shared/``), else ``../shared`` beside the repository. Absolute either way,
    as tests change their working directory."""
    named = environ.get(GSM8K_TRAIN_VARIABLE)
    if named:
        return Path(named).expanduser().resolve()
    return REPO_ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"


GSM8K_TRAIN = gsm8k_train_location(os.environ)
SYSTEM_TESTS = Path(__file__).resolve().parent / "system"
SMOKE_CONFIG = REPO_ROOT / "configs" / "smoke.yaml"


def pytest_collection_modifyitems(config, items):
    """Mark what lies under system/; leave out ``slow`` tests unless ``-m`` names them, so that a
    selection such as ``-m "not system"`` does not pull in minutes of the built-in model."""
    for item in items:
        if item.path.is_relative_to(SYSTEM_TESTS):
            item.add_marker(pytest.mark.system)
    if "slow" in (config.option.markexpr or ""):
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]


def pytest_make_parametrize_id(config, val, argname):
    """A readable id for a case pytest would only number (``kwargs3``): a dict, list, tuple or set
    shows what it holds, so a failing case of a table says which one it is."""
    if isinstance(val, dict | list | tuple | set | frozenset):
        return _case_id(val).encode("ascii", "backslashreplace").decode()[:48] or "empty"
    return None


def _case_id(val) -> str:
    if isinstance(val, dict):
        return ",".join(f"{key}={_case_id(value)}" for key, value in val.items())
    if isinstance(val, list | tuple):
        return ",".join(_case_id(item) for item in val)
    if isinstance(val, set | frozenset):
        return ",".join(sorted(_case_id(item) for item in val))
    return " ".join(str(getattr(val, "__name__", val)).split())


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama + byte-level BPE tokenizer with a ChatML template (a few seconds)."""
    from posttrain.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def smoke_config_path() -> Path:
    """configs/smoke.yaml: the tiny random model through every stage for 2 steps."""
    return SMOKE_CONFIG


def smoke_places(workdir: Path, store: str = "store") -> list[str]:
    """Overrides that keep everything a smoke run writes under ``workdir``: the store (named
    ``store``), the MLflow database and the built tiny model."""
    return [
        f"orchestration.store={workdir / store}",
        f"tracking.tracking_uri=sqlite:///{workdir / 'mlflow.db'}",
        f"model.cache_dir={workdir / 'models'}",
    ]


@pytest.fixture(scope="session")
def smoke_config():
    """``smoke_config(workdir, *overrides, store="store", config=SMOKE_CONFIG)``: the smoke config (or
    another ``config`` file) with ``overrides``, writing only under ``workdir`` (smoke_places)."""
    from posttrain.pipeline import load_config

    def build(workdir: Path, *overrides: str, store: str = "store", config: Path = SMOKE_CONFIG):
        return load_config(config, [*smoke_places(workdir, store), *overrides])

    return build


@pytest.fixture(scope="session")
def smoke_sets():
    """``smoke_sets(workdir, *overrides)``: the same overrides as ``--set`` arguments of the CLI."""

    def sets(workdir: Path, *overrides: str) -> list[str]:
        return [arg for s in (*smoke_places(workdir), *overrides) for arg in ("--set", s)]

    return sets


@dataclass(frozen=True)
class SmokeRun:
    """The smoke config run once from an empty store: where it wrote and the flow's summary."""

    workdir: Path
    summary: dict

    @property
    def store(self) -> Path:
        return self.workdir / "store"

    @property
    def tracking_uri(self) -> str:
        return f"sqlite:///{self.workdir / 'mlflow.db'}"

    def output(self, step: str) -> Path:
        return Path(next(o["output"] for o in self.summary["outcomes"] if o["step"] == step))

    def restore(self) -> None:
        """Put the store back as the first run left it (what a test changed goes)."""
        for entry in self.store.iterdir():
            if entry.name in _KEPT:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
        shutil.copytree(self.workdir / "pristine-store", self.store, symlinks=True, dirs_exist_ok=True)


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory, smoke_config) -> SmokeRun:
    """The whole smoke pipeline, run once per session. Tests that only read its store, its MLflow
    runs or its summary take this; a test that changes the store takes ``smoke_store``."""
    from posttrain.flows.pipeline_flow import posttrain_pipeline

    workdir = tmp_path_factory.mktemp("smoke-run")
    # MLflow samples system metrics every 10 s by default; the smoke stages last a few seconds.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.5")
        summary = posttrain_pipeline(smoke_config(workdir))
    # The store as the run left it, to put back after each test that changes it. Put back in place,
    # not copied elsewhere: records name their outputs by absolute path inside the store, and an
    # output outside the store is recomputed, so a copy at another path would be a cold store.
    shutil.copytree(workdir / "store", workdir / "pristine-store", symlinks=True, ignore=_PRISTINE_SKIP)
    return SmokeRun(workdir, summary)


_KEPT = ("prefect", "lock", "locks")
"""Left as they are when a store is put back: a Prefect home (a server may hold it open) and the locks."""
_PRISTINE_SKIP = shutil.ignore_patterns(*_KEPT)


@pytest.fixture
def smoke_store(smoke_run) -> Iterator[SmokeRun]:
    """``smoke_run`` for a test that changes its store (damages an output, reruns a step): the store
    is put back as the first run left it afterwards. MLflow's database is left as it is (a client may
    hold it open); the records still name the first run's MLflow runs, which it keeps."""
    yield smoke_run
    smoke_run.restore()


def _real_gsm8k_train() -> Path:
    if not GSM8K_TRAIN.exists():
        message = (
            f"real GSM8K train split not found at {GSM8K_TRAIN} (set {GSM8K_TRAIN_VARIABLE} to its path)"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return GSM8K_TRAIN


@pytest.fixture
def gsm8k_train_path() -> Path:
    """The real GSM8K train split (:func:`gsm8k_train_location`). CI always has it, so there a
    missing file is a failure, not a silent skip; elsewhere (a bare clone) the test is skipped."""
    return _real_gsm8k_train()


GSM8K_TEST_SIZE = 1319
"""Questions in GSM8K's test split, and so in the stand-in for it that the tests hold out of train."""


@pytest.fixture(scope="session")
def gsm8k_splits(tmp_path_factory) -> Path:
    """A folder as ``posttrain data fetch gsm8k`` leaves ``data/gsm8k/``: ``train.jsonl`` and
    ``test.jsonl``. The test split is kept off this project's machines, so the real train split's
    last 1,319 questions stand in for it and the rest is the train file (``posttrain data hold-out``)."""
    from posttrain.data.sources import hold_out_last

    folder = tmp_path_factory.mktemp("gsm8k")
    hold_out_last(_real_gsm8k_train(), GSM8K_TEST_SIZE, folder / "train.jsonl", folder / "test.jsonl")
    return folder


@pytest.fixture
def in_clone_with_gsm8k(gsm8k_splits, tmp_path, monkeypatch) -> Path:
    """A working directory where the shipped configs' ``data/gsm8k/`` paths find :func:`gsm8k_splits`,
    as they find the fetched splits in a clone: no test points a shipped config outside it."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "gsm8k").symlink_to(gsm8k_splits, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


SPY_DIR = Path(__file__).resolve().parent / "spy"
"""step_spy.py and the sitecustomize.py that installs it in spawned worker processes."""


@pytest.fixture
def step_spy(monkeypatch, tmp_path_factory):
    """The steps that actually ran, in this process and in every worker process it spawns (a label
    saying `cached` proves nothing): a sequence of step names, with their spans and hooks
    (tests/spy/step_spy.py)."""
    monkeypatch.syspath_prepend(str(SPY_DIR))
    import step_spy as spy

    folder = tmp_path_factory.mktemp("step-spy")
    monkeypatch.setenv(spy.ENV, str(folder))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(SPY_DIR), os.environ.get("PYTHONPATH")]))
    )
    spy.install(folder, monkeypatch.setattr)
    return spy.CallLog(folder)


@pytest.fixture
def step_calls(step_spy):
    """Names of the step functions that actually ran, in order."""
    return step_spy


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server on 127.0.0.1 for the session (tests/servers.py), from Debian's
    `postgresql` package. CI must run the tests that use it, so there a missing server is a failure;
    elsewhere they are skipped with the reason."""
    from servers import postgres_bindir, postgres_server

    bindir = postgres_bindir()
    if bindir is None:
        message = "PostgreSQL's server is not installed (Debian: apt-get install postgresql; make test does it as root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    with postgres_server(bindir) as server:
        yield server
