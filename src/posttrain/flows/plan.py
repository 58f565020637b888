"""Which steps run and which are served from cache, and why: used by the flow and by `--dry-run`.

A step is cached when Prefect's result store holds a record under its key and the output that
record points to is still there, unmodified. `--force STAGE` reruns that stage and everything
after it: a forced retrain may produce identical weights, and the user asked for the rest too.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefect.filesystems import LocalFileSystem
from prefect.results import ResultStore

from posttrain import steps
from posttrain.config import ConfigError, PipelineConfig
from posttrain.store import Store

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    status: str
    """`cached` or `run`."""
    reason: str


class Planner:
    def __init__(self, cfg: PipelineConfig, store: Store, force: Sequence[str] = ()):
        valid = {"data", *cfg.stage_names()}
        unknown = sorted(set(force) - valid)
        if unknown:
            raise ConfigError(
                f"--force {', '.join(unknown)}: not a step of {cfg.name}; steps: {', '.join(sorted(valid))}"
            )
        self.cfg, self.store, self.force = cfg, store, set(force)
        self.forced_from: str | None = None
        self._results = ResultStore(result_storage=LocalFileSystem(basepath=str(store.results_dir)))

    def cached_result(self, key: str) -> Any | None:
        """The cached result under ``key`` if its output is intact, else None."""
        if not self._results.exists(key):
            return None
        try:
            result = self._results.read(key).result
        except Exception as exc:  # an unreadable record is a cache miss, never a crash
            logger.warning("cache record %s is unreadable (%s); recomputing", key, exc)
            return None
        return result if steps.output_is_valid(result) else None

    def decide(self, step: str, key: str) -> Decision:
        if step in self.force and self.forced_from is None:
            self.forced_from = step
        if self.forced_from is not None:
            why = "forced" if step == self.forced_from else f"after forced {self.forced_from}"
            return Decision("run", why)
        if not self.cfg.orchestration.cache:
            return Decision("run", "caching disabled (orchestration.cache: false)")
        if not self._results.exists(key):
            return Decision("run", "no cache entry for these inputs/config")
        if self.cached_result(key) is None:
            return Decision("run", "cached output missing or modified")
        return Decision("cached", f"cache hit {key[:12]}")


def dry_run(cfg: PipelineConfig, force: Sequence[str] = ()) -> list[tuple[str, str, str]]:
    """(step, status, reason) for every step, without running anything.

    Keys downstream of a step that would run depend on that step's new output, so those steps are
    reported as `run` with the upstream step named.
    """
    store = Store.at(cfg.orchestration.store)
    planner = Planner(cfg, store, force)
    rows: list[tuple[str, str, str]] = []
    base = steps.base_model(cfg)
    key = steps.data_key(cfg, base.fingerprint)
    decision = planner.decide("data", key)
    rows.append(("data", decision.status, decision.reason))
    data = planner.cached_result(key) if decision.status == "cached" else None
    upstream = None if data is not None else "data"
    model = base
    pending = [("baseline", None)] if cfg.eval.baseline else []
    stages = cfg.stage_names()
    for i, stage in enumerate(stages):
        pending.append((stage, "train"))
        if cfg.eval.after_each_stage or i == len(stages) - 1:
            pending.append((stage, None))
    for stage, kind in pending:
        step = stage if kind == "train" else f"eval-{stage}"
        if upstream is not None:
            rows.append((step, "run", f"after {upstream} reruns"))
            continue
        key = (steps.train_key if kind == "train" else steps.eval_key)(cfg, stage, model, data)
        decision = planner.decide(step, key)
        rows.append((step, decision.status, decision.reason))
        if kind == "train":
            result = planner.cached_result(key) if decision.status == "cached" else None
            if result is None:
                upstream = stage
            else:
                model = steps.ModelRef(result.output_dir, result.fingerprints["output"])
    return rows
