"""The planner's decisions: for each step of a plan, served from cache or run, and why.

A step is cached when the records hold a result under its key and the output that result points
to is still there, unmodified (:class:`Planner`). :func:`dry_run` asks the same questions of every
step without running anything (``--dry-run``). The plan itself (``posttrain.pipeline.plan``) is
seen through :class:`PlanStep` and :class:`StepPlan`: what the planner needs of a step is its key's
identity, where its output lives and how that output is verified.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from posttrain.cache.keys import StepIdentity
from posttrain.cache.records import RecordError, path_outside, read_output_result
from posttrain.cache.shared import SharedStore
from posttrain.cache.store import Store
from posttrain.core.config import PipelineConfig
from posttrain.core.errors import PosttrainError
from posttrain.core.untrusted import note_unreadable

__all__ = ["CacheRecords", "Decision", "PlanStep", "Planner", "StepPlan", "dry_run"]


class PlanStep(Protocol):
    """What the planner needs of a plan step (``posttrain.pipeline.plan.Step``)."""

    kind: str
    name: str
    feeds_downstream: bool

    def identity(self, cfg: PipelineConfig, inputs: Any) -> StepIdentity: ...

    def output_dir(self, store: Store, key: str) -> Path: ...

    def output_of(self, result: Any) -> str: ...

    def output_is_valid(self, result: Any) -> bool: ...

    def made_from(self, result: Any, inputs: Any) -> bool: ...


class StepPlan(Protocol):
    """What the planner needs of a plan (``posttrain.pipeline.plan.Plan``)."""

    config: PipelineConfig

    def check_force(self, force: Sequence[str]) -> None: ...

    def walk(self, base: Any, visit: Callable[[Any, str | None, Any], Any]) -> Any: ...


class CacheRecords(Protocol):
    """Where cached step results are kept (JSON records in the store: :mod:`posttrain.cache.records`)."""

    def exists(self, key: str) -> bool: ...

    def read(self, key: str, kind: str | None = None) -> Any: ...

    def code_of_lineage(self, lineage: str) -> dict[str, str] | None:
        """The code fingerprint files of the latest record of this lineage (None: no such record)."""
        ...


@dataclass(frozen=True)
class Decision:
    status: str
    """`cached` or `run`."""
    reason: str
    result: Any = field(default=None, compare=False, repr=False)
    """The verified cached result when `cached`."""
    adopted: bool = False
    """`cached` from a complete output whose cache record is missing: the caller writes the record."""


class Planner:
    """Which steps run and which are served from cache, and why: used by the flow and by ``--dry-run``.

    A step is cached when the records hold a result under its key and the output that result points
    to is still there, unmodified. With the ``store``, a step whose record is missing but whose
    output is there (a kill fell between the output's rename and its record) is *adopted*: the
    result the output carries is checked like a cached one (content fingerprint, inputs, path) and
    used instead of recomputing; an output that fails the check is recomputed and replaced.
    ``--force STEP`` reruns that step and everything after it: a forced retrain may produce
    identical weights, and the user asked for the rest too.
    """

    def __init__(
        self,
        plan: StepPlan,
        records: CacheRecords,
        force: Sequence[str] = (),
        store: Store | None = None,
        shared: SharedStore | None = None,
    ):
        plan.check_force(force)
        self.plan, self.records, self.force, self.store = plan, records, set(force), store
        self.shared = shared
        """With a shared store, an output missing here is pulled from it, then adopted (verified)."""
        self.forced_from: str | None = None

    def cached_result(self, step: PlanStep, key: str) -> Any | None:
        """The cached result under ``key`` if its output is intact, else None."""
        return self._lookup(step, key)[0]

    def _lookup(self, step: PlanStep, key: str, inputs: Any | None = None) -> tuple[Any | None, str]:
        """(result, "") for a usable cache entry, else (None, why not)."""
        if not self.records.exists(key):
            return None, self._unrecorded_output(step, key) or self._why_missing(step, inputs)
        try:
            result = self.records.read(key, step.kind)
        except Exception as exc:  # an unreadable record is a cache miss, never a crash
            note_unreadable(f"cache record {key} is unreadable ({exc})")
            return None, "cache record unreadable"
        if (outside := self._outside(step, key, result)) is not None:
            note_unreadable(f"cache record {key}: names {outside}, outside the store {self._root}")
            return None, "cache record points outside the store"
        if not self._verified(step, result, inputs):
            return None, "cached output missing or modified"
        return result, ""

    @property
    def _root(self) -> Path | None:
        return self.store.root if self.store is not None else None

    def _outside(self, step: PlanStep, key: str, result: Any) -> str | None:
        """A path of ``result`` that is not where this store keeps ``key``'s output (None: all are).
        Records and ``.result.json`` files are store contents: they may name any folder on the
        machine, and a cached output is served only from inside the store."""
        if self.store is None:
            return None
        expected = str(step.output_dir(self.store, key).resolve())
        if step.output_of(result) != expected:
            return step.output_of(result)
        return path_outside(result, self.store.root)

    def _verified(self, step: PlanStep, result: Any, inputs: Any | None) -> bool:
        """The output is intact and made from ``inputs``; damaged store contents (a malformed
        ``stage.json`` or report) are a miss, logged once, never a crash."""
        try:
            if inputs is not None and not step.made_from(result, inputs):
                return False
            return step.output_is_valid(result)
        except (
            PosttrainError,
            OSError,
            ValueError,
            KeyError,
            TypeError,
            AttributeError,
            RecursionError,
        ) as exc:
            note_unreadable(f"{step.output_of(result)}: {exc}")
            return False

    def adoptable(self, step: PlanStep, key: str, inputs: Any) -> Any | None:
        """The verified result of ``step``'s output under ``key`` when it has no cache record, else None."""
        if self.store is None or self.records.exists(key):
            return None
        out = step.output_dir(self.store, key)
        try:
            result = read_output_result(step.kind, out)
        except RecordError as exc:
            if out.exists():
                note_unreadable(exc)
            return None
        if (outside := self._outside(step, key, result)) is not None:
            note_unreadable(f"{out}: its result names {outside}, outside the store {self._root}")
            return None
        return result if self._verified(step, result, inputs) else None

    def _pull(self, step: PlanStep, key: str) -> bool:
        """Download ``key``'s output from the shared store when this store has neither record nor output."""
        if self.shared is None or self.store is None or self.records.exists(key):
            return False
        output_dir = step.output_dir(self.store, key)
        return not output_dir.exists() and self.shared.pull(step.kind, key, output_dir)

    def _unrecorded_output(self, step: PlanStep, key: str) -> str:
        """Why an output without a record is not adopted ("" when there is no such output)."""
        if self.store is None or not step.output_dir(self.store, key).exists():
            return ""
        return "output without a cache record failed verification: recomputing"

    def _why_missing(self, step: PlanStep, inputs: Any | None) -> str:
        """No record under the key: say so, or that only the code changed since the last one."""
        missing = "no cache entry for these inputs/config"
        lookup = getattr(self.records, "code_of_lineage", None)
        if inputs is None or lookup is None:
            return missing
        identity = step.identity(self.plan.config, inputs)
        before = lookup(identity.lineage)
        if before is None:
            return missing
        changed = identity.code.changed(before)
        if not changed:
            return missing
        more = f" (+{len(changed) - 3} more)" if len(changed) > 3 else ""
        return f"code changed: {', '.join(changed[:3])}{more}"

    def decide(self, step: PlanStep, key: str, inputs: Any | None = None) -> Decision:
        if step.name in self.force and self.forced_from is None:
            self.forced_from = step.name
        if self.forced_from is not None:
            why = "forced" if step.name == self.forced_from else f"after forced {self.forced_from}"
            return Decision("run", why)
        if not self.plan.config.orchestration.cache:
            return Decision("run", "caching disabled (orchestration.cache: false)")
        pulled = inputs is not None and self._pull(step, key)
        if inputs is not None and (adopted := self.adoptable(step, key, inputs)) is not None:
            why = (
                "pulled from the shared store"
                if pulled
                else "complete output adopted (its cache record was missing)"
            )
            return Decision("cached", why, adopted, True)
        result, why = self._lookup(step, key, inputs)
        if result is None:
            return Decision("run", why)
        return Decision("cached", f"cache hit {key[:12]}", result)


def dry_run(
    plan: StepPlan, records: CacheRecords, base: Any, force: Sequence[str] = (), store: Store | None = None
) -> list[tuple[str, str, str]]:
    """(step, status, reason) for every step of ``plan``, without running anything.

    Keys downstream of a step that would run depend on that step's new output, so those steps are
    reported as `run` with the upstream step named. With ``store``, outputs whose record is missing
    are shown as they would be adopted (nothing is written).
    """
    planner = Planner(plan, records, force, store)
    rows: list[tuple[str, str, str]] = []
    upstream: list[str] = []

    def visit(step: PlanStep, key: str | None, inputs: Any) -> Any:
        if key is None:
            rows.append((step.name, "run", f"after {upstream[0]} reruns"))
            return None
        decision = planner.decide(step, key, inputs)
        rows.append((step.name, decision.status, decision.reason))
        result = decision.result
        if result is None and step.feeds_downstream and not upstream:
            upstream.append(step.name)
        return result

    plan.walk(base, visit)
    return rows
