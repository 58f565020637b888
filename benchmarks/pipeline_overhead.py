"""What Prefect + MLflow + caching cost on top of the work itself, measured side by side in one run.

1. direct: the smoke config's steps called as plain functions (`posttrain.pipeline.steps`), no Prefect, no MLflow,
           in a fresh process with a fresh store.
2. flow:   `posttrain run configs/smoke.yaml` in a fresh process with a fresh store (everything runs;
           Prefect's and MLflow's databases are created and migrated: a one-time cost per store).
3. rerun:  the same command again, unchanged (everything cached), ``--repeat`` times (3): the wall
           time a user waits, and the CPU time it costs (user + system, the Prefect server's included).
4. again:  the same command with `--force data` (every step runs again) on the existing store: what
           Prefect + MLflow cost on every later run.

Both sides are whole processes timed from outside, so both pay for importing torch, transformers
and TRL and for building the same models; the difference is what Prefect, MLflow, the cache
records and the CLI add. Prints the overhead of a run on an existing store (again - direct), of
the first run on a new store (flow - direct) and the rerun time.
Targets: overhead <= 10 s per run, cached rerun <= 10 s.

With ``--store PATH`` only the cached rerun is measured, on an existing store that already holds
every step of ``--config`` (the demo config needs its 25 minutes of training first:
``make demo``, then ``--config configs/smollm2-gsm8k-cpu.yaml --store .posttrain``); the
rerun runs in the current directory, so it logs to the same MLflow store as the run that filled it.

Usage: .venv/bin/python benchmarks/pipeline_overhead.py [--config configs/smoke.yaml] [--store PATH] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def direct_steps(config: Path, store_dir: Path) -> None:
    """Every step of the pipeline's plan, in order, as plain function calls."""
    from posttrain.cache.store import Store
    from posttrain.pipeline import load_config
    from posttrain.pipeline.plan import build_plan
    from posttrain.pipeline.steps import base_model

    cfg = load_config(config, [f"orchestration.store={store_dir}"])
    store = Store.at(cfg.orchestration.store)

    def run(step, key, inputs):
        return step.run(cfg, inputs, str(step.output_dir(store, key)))

    build_plan(cfg).walk(base_model(cfg), run)


def run_direct(config: Path, workdir: Path) -> float:
    cmd = [sys.executable, __file__, "--direct", str(config), str(workdir / "direct-store")]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=workdir, env=_clean_env(), stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}


def run_cli(config: Path, workdir: Path, *extra: str, store: Path | None = None) -> float:
    return _timed_cli(config, workdir, *extra, store=store)[0]


def _timed_cli(config: Path, workdir: Path, *extra: str, store: Path | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of the command and its children) of one ``posttrain run``."""
    cmd = [
        str(Path(sys.executable).parent / "posttrain"),
        "-q",
        "run",
        str(config),
        "--set",
        f"orchestration.store={store or workdir / 'flow-store'}",
        *extra,
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=workdir, env=_clean_env(), stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def all_cached(config: Path, workdir: Path, store: Path) -> list[str]:
    """Steps of ``config`` that a run on ``store`` would not serve from cache (``--dry-run``)."""
    cmd = [
        str(Path(sys.executable).parent / "posttrain"),
        "-q",
        "run",
        str(config),
        "--dry-run",
        "--set",
        f"orchestration.store={store}",
    ]
    out = subprocess.run(
        cmd, check=True, cwd=workdir, env=_clean_env(), capture_output=True, text=True
    ).stdout
    rows = [line.split() for line in out.splitlines()[2:] if line.strip()]
    return [row[0] for row in rows if len(row) > 1 and row[1] != "cached"]


def reruns(config: Path, workdir: Path, repeat: int, store: Path | None = None) -> list[tuple[float, float]]:
    return [_timed_cli(config, workdir, store=store) for _ in range(repeat)]


def _report_reruns(times: list[tuple[float, float]]) -> None:
    walls = [w for w, _ in times]
    median = statistics.median(walls)
    print(
        f"cached rerun (median of {len(times)}): {median:7.1f} s   target <= 10 s  "
        f"{'ok' if median <= 10 else 'MISSED'}"
    )
    print("  each (wall / CPU):           " + ", ".join(f"{w:.1f} / {c:.1f} s" for w, c in times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "smoke.yaml")
    parser.add_argument(
        "--store",
        type=Path,
        help="an existing store holding every step of --config: time its cached rerun only",
    )
    parser.add_argument("--repeat", type=int, default=3, help="cached reruns to time (default 3)")
    parser.add_argument("--direct", nargs=2, metavar=("CONFIG", "STORE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.direct:
        direct_steps(Path(args.direct[0]), Path(args.direct[1]))
        return
    config = args.config.resolve()
    if args.store:
        store, workdir = args.store.resolve(), Path.cwd()
        if missing := all_cached(config, workdir, store):
            raise SystemExit(
                f"{store} does not hold every step of {args.config}: {', '.join(missing)} would run"
            )
        print(f"config: {args.config}  store: {store}")
        _report_reruns(reruns(config, workdir, args.repeat, store))
        return
    with tempfile.TemporaryDirectory(prefix="posttrain-bench-") as tmp:
        workdir = Path(tmp)
        # Build the model cache once so neither side pays for it.
        from posttrain.models.resolve import resolve_model_path
        from posttrain.pipeline import load_config

        resolve_model_path(load_config(args.config).model.name)
        direct = run_direct(config, workdir)
        flow = run_cli(config, workdir)
        rerun = reruns(config, workdir, args.repeat)
        again = run_cli(config, workdir, "--force", "data")
    overhead = again - direct
    print(f"config: {args.config}")
    print(f"direct step calls:            {direct:7.1f} s   (new process, new store, no Prefect or MLflow)")
    print(f"posttrain run, new store:     {flow:7.1f} s   (creates Prefect's and MLflow's databases)")
    print(f"posttrain run --force data:   {again:7.1f} s   (existing store, every step runs)")
    print(
        f"overhead per run:             {overhead:7.1f} s   target <= 10 s  {'ok' if overhead <= 10 else 'MISSED'}"
    )
    print(f"overhead of a new store's first run: {flow - direct:.1f} s")
    _report_reruns(rerun)


if __name__ == "__main__":
    main()
