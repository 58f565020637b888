"""The shape of the code: layers that only depend downward, Prefect and MLflow kept to their rooms,
and a package that installs as one `posttrain` whose Prefect layer loads by its file entrypoint.

The contracts live in pyproject.toml ([tool.importlinter]); these tests run them, and run them once
more on a copy of the code with an upward import planted, so a contract that stopped checking
anything would fail here too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", "--config", str(REPO / "pyproject.toml")],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )


def _package_copy(tmp_path: Path) -> Path:
    """src/posttrain, flows/ and tasks/ laid out as the one package they install as."""
    root = tmp_path / "site"
    shutil.copytree(
        REPO / "src" / "posttrain", root / "posttrain", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("flows", "tasks"):
        shutil.copytree(REPO / name, root / "posttrain" / name, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def test_import_contracts_hold():
    result = _lint()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "planted", "contract"),
    [
        ("core/gsm8k.py", "import posttrain.data.sources", "layers"),  # core reaching up into data
        ("models/resolve.py", "import posttrain.training.stage_run", "layers"),  # models reaching up
        ("evaluation/scoring.py", "import posttrain.training.grpo", "layers"),  # sibling layers
        ("pipeline/plan.py", "import prefect", "only flows/ and tasks/ import Prefect"),
        ("training/sft.py", "import mlflow", "only tracking/ imports MLflow"),
        ("training/sft.py", "import posttrain.training.grpo", "no cycles"),  # and grpo imports sft
    ],
)
def test_a_planted_violation_breaks_its_contract(tmp_path, module, planted, contract):
    root = _package_copy(tmp_path)
    target = root / "posttrain" / module
    target.write_text(target.read_text() + f"\n{planted}\n")
    if contract == "no cycles":
        (root / "posttrain" / "training" / "grpo.py").write_text(
            (root / "posttrain" / "training" / "grpo.py").read_text() + "\nimport posttrain.training.sft\n"
        )
    result = _lint({**os.environ, "PYTHONPATH": str(root)})
    assert result.returncode != 0
    broken = result.stdout.split("Broken contracts", 1)[-1]
    assert contract in broken, result.stdout[-3000:]


def test_every_package_folder_is_listed_for_the_wheel():
    # setuptools' explicit `packages` list is not recursive: a package left out is silently
    # missing from the wheel while an editable install still imports it.
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {
        ".".join(p.parent.relative_to(REPO / "src").parts)
        for p in (REPO / "src" / "posttrain").rglob("__init__.py")
    }
    found |= {f"posttrain.{name}" for name in ("flows", "tasks")}
    assert listed == found


def test_wheel_installs_one_posttrain_package(tmp_path):
    wheels = tmp_path / "dist"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(REPO),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("posttrain-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "posttrain/flows/pipeline_flow.py" in names and "posttrain/tasks/step_task.py" in names
    assert not [n for n in names if n.split("/")[0] in ("flows", "tasks", "src")]
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    code = "import posttrain, posttrain.flows.pipeline_flow, posttrain.tasks.step_task; print(posttrain.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(target)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith(str(target))


def test_prefect_loads_the_flow_by_its_file_entrypoint():
    code = (
        "from prefect.flows import load_flow_from_entrypoint as load;"
        "print(load('flows/pipeline_flow.py:posttrain_pipeline').name, load('flows/pipeline_flow.py:run_config').name)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={
            **os.environ,
            "PREFECT_HOME": "/nonexistent-unused",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["posttrain-pipeline", "posttrain-run-config"]


def test_prefect_yaml_names_the_flow_entrypoints():
    import yaml

    spec = yaml.safe_load((REPO / "prefect.yaml").read_text())
    for deployment in spec["deployments"]:
        file, _, flow = deployment["entrypoint"].partition(":")
        assert (REPO / file).is_file() and f"def {flow}(" in (REPO / file).read_text()


# What the flow needs to serve a step from cache: plan, records, store, tracking and the flow itself.
CACHED_RERUN_MODULES = (
    "posttrain.cli",
    "posttrain.pipeline.plan",
    "posttrain.cache.records",
    "posttrain.flows.pipeline_flow",
    "posttrain.flows.plan_walker",
    "posttrain.tasks.step_task",
    "posttrain.tracking",
    "posttrain.evaluation.report",
)
HEAVY = ("torch", "transformers", "datasets", "trl", "peft")


def test_a_cached_rerun_imports_no_training_library():
    """The modules a rerun served from cache loads leave torch, transformers, datasets, TRL and
    peft unimported (seconds of CPU each): the steps import them when they run."""
    code = (
        "import importlib, sys\n"
        f"for name in {CACHED_RERUN_MODULES!r}: importlib.import_module(name)\n"
        f"print(' '.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.split() == []
