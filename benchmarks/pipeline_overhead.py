"""What Prefect + MLflow + caching cost on top of the work itself, measured side by side in one run.

1. direct: the smoke config's steps called as plain functions (`posttrain.pipeline.steps`), no Prefect, no MLflow,
           in a fresh process with a fresh store.
2. flow:   `posttrain run configs/smoke.yaml` in a fresh process with a fresh store (everything runs;
           Prefect's and MLflow's databases are created and migrated: a one-time cost per store).
3. rerun:  the same command again, unchanged (everything cached): the wall time a user waits.
4. again:  the same command with `--force data` (every step runs again) on the existing store: what
           Prefect + MLflow cost on every later run.

Both sides are whole processes timed from outside, so both pay for importing torch, transformers
and TRL and for building the same models; the difference is what Prefect, MLflow, the cache
records and the CLI add. Prints the overhead of a run on an existing store (again - direct), of
the first run on a new store (flow - direct) and the rerun time.
Targets: overhead <= 10 s per run, rerun <= 15 s.
Usage: .venv/bin/python benchmarks/pipeline_overhead.py [--config configs/smoke.yaml]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def direct_steps(config: Path, store_dir: Path) -> None:
    """Every step of the pipeline, in order, as plain function calls."""
    from posttrain import steps
    from posttrain.pipeline import load_config
    from posttrain.pipeline.store import Store

    cfg = load_config(config, [f"orchestration.store={store_dir}"])
    store = Store.at(cfg.orchestration.store)
    base = steps.base_model(cfg)
    data = steps.prepare_step(cfg, base, store.data_dir(steps.data_key(cfg, base.fingerprint)))
    model = base
    if cfg.eval.baseline:
        steps.eval_step(
            cfg,
            "baseline",
            model,
            data,
            store.eval_dir("baseline", steps.eval_key(cfg, "baseline", model, data)),
        )
    stages = cfg.stage_names()
    for i, stage in enumerate(stages):
        result = steps.train_step(
            cfg, stage, model, data, store.stage_dir(stage, steps.train_key(cfg, stage, model, data))
        )
        model = steps.ModelRef(result.output_dir, result.fingerprints["output"])
        if cfg.eval.after_each_stage or i == len(stages) - 1:
            steps.eval_step(
                cfg, stage, model, data, store.eval_dir(stage, steps.eval_key(cfg, stage, model, data))
            )


def run_direct(config: Path, workdir: Path) -> float:
    cmd = [sys.executable, __file__, "--direct", str(config), str(workdir / "direct-store")]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=workdir, env=_clean_env(), stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}


def run_cli(config: Path, workdir: Path, *extra: str) -> float:
    cmd = [
        str(Path(sys.executable).parent / "posttrain"),
        "-q",
        "run",
        str(config),
        "--set",
        f"orchestration.store={workdir / 'flow-store'}",
        *extra,
    ]
    start = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=workdir, env=_clean_env(), stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "smoke.yaml")
    parser.add_argument("--direct", nargs=2, metavar=("CONFIG", "STORE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.direct:
        direct_steps(Path(args.direct[0]), Path(args.direct[1]))
        return
    with tempfile.TemporaryDirectory(prefix="posttrain-bench-") as tmp:
        workdir = Path(tmp)
        # Build the model cache once so neither side pays for it.
        from posttrain.models.resolve import resolve_model_path
        from posttrain.pipeline import load_config

        resolve_model_path(load_config(args.config).model.name)
        direct = run_direct(args.config.resolve(), workdir)
        flow = run_cli(args.config.resolve(), workdir)
        rerun = run_cli(args.config.resolve(), workdir)
        again = run_cli(args.config.resolve(), workdir, "--force", "data")
    overhead = again - direct
    print(f"config: {args.config}")
    print(f"direct step calls:            {direct:7.1f} s   (new process, new store, no Prefect or MLflow)")
    print(f"posttrain run, new store:     {flow:7.1f} s   (creates Prefect's and MLflow's databases)")
    print(f"posttrain run --force data:   {again:7.1f} s   (existing store, every step runs)")
    print(
        f"overhead per run:             {overhead:7.1f} s   target <= 10 s  {'ok' if overhead <= 10 else 'MISSED'}"
    )
    print(f"overhead of a new store's first run: {flow - direct:.1f} s")
    print(
        f"unchanged rerun:              {rerun:7.1f} s   target <= 15 s  {'ok' if rerun <= 15 else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
