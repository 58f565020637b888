"""Code fingerprints: the source each kind of step depends on, so a code change reruns what it affects.

A step's cache key (:mod:`posttrain.cache.keys`) includes :func:`code_fingerprint` of its kind:

* the source of every posttrain module the kind's entry modules import, followed transitively
  (imports inside functions included: read with :mod:`ast`, nothing is imported), so a fix to a
  reward reruns GRPO and DPO (which score with rewards) but not SFT, the data or evaluations;
  hashed as its syntax tree without docstrings (:func:`source_digest`), so a reworded docstring
  or comment reruns nothing;
* the source of the kind's own step code (:data:`STEP_SOURCES`: its function or its plan step's
  class, not the whole module, which holds every kind), read with :mod:`ast` too;
* the versions of the libraries the kind runs on (a TRL upgrade reruns training, not data);
* for GRPO and DPO, the source file of each custom ``module:function`` reward (only with the
  custom-code opt-in: without it the stage is refused anyway, and nothing is imported here).

The fingerprint keeps the hash of each file, so the planner can say which files changed
(``--dry-run``: ``code changed: posttrain/rewards/format.py``).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import posttrain
from posttrain.cache.digests import sha256_file
from posttrain.core.hashing import package_versions
from posttrain.core.library_policy import custom_code_allowed, is_custom

__all__ = [
    "ENTRY_MODULES",
    "NOT_CALLED",
    "STEP_SOURCES",
    "CodeFingerprint",
    "code_fingerprint",
    "module_closure",
    "source_digest",
]

ENTRY_MODULES: dict[str, tuple[str, ...]] = {
    "data": ("posttrain.data.prepare", "posttrain.data.eval_sets", "posttrain.models.loading"),
    "eval": ("posttrain.evaluation.evaluator", "posttrain.data.eval_sets", "posttrain.models.loading"),
    "sft": ("posttrain.training.sft",),
    "dpo": ("posttrain.training.dpo",),
    "grpo": ("posttrain.training.grpo",),
    "rft": ("posttrain.training.sft", "posttrain.data.builders", "posttrain.evaluation.pass_rate"),
    "score": ("posttrain.evaluation.pass_rate", "posttrain.data.prepare", "posttrain.models.loading"),
}
"""The modules each step kind runs, besides its own step code (:data:`STEP_SOURCES`)."""
_STEPS, _PLAN = "posttrain.pipeline.steps", "posttrain.pipeline.plan"
STEP_SOURCES: dict[str, tuple[tuple[str, str], ...]] = {
    "data": tuple(
        (_STEPS, f) for f in ("prepare_step", "_external_eval_records", "_set_records", "load_data")
    ),
    "eval": tuple((_STEPS, f) for f in ("eval_step", "_set_records", "load_data")),
    "sft": (
        (_PLAN, "SFTStep"),
        (_STEPS, "load_data"),
        (_STEPS, "in_training_records"),
        (_STEPS, "evaluation_inputs"),
    ),
    "dpo": (
        (_PLAN, "DPOStep"),
        (_STEPS, "load_data"),
        (_STEPS, "in_training_records"),
        (_STEPS, "evaluation_inputs"),
    ),
    "grpo": ((_PLAN, "GRPOStep"), (_STEPS, "load_data"), (_STEPS, "in_training_records")),
    "rft": (
        (_PLAN, "RFTStep"),
        (_PLAN, "GRPOStep"),
        (_STEPS, "load_data"),
        (_STEPS, "in_training_records"),
        (_STEPS, "scoring_candidates"),
    ),
    "score": ((_STEPS, "score_step"), (_STEPS, "load_data"), (_STEPS, "scoring_candidates")),
}
"""(module, top-level function or class) of each kind's own step code."""
NOT_CALLED: dict[str, tuple[str, ...]] = {"sft": ("posttrain.rewards",)}
"""Packages a kind's closure leaves out although a shared module imports them: ``training/stage_run.py``
imports the reward registry for ``build_reward_funcs``, which only GRPO and DPO call (a test checks
that SFT's own module never names rewards)."""
LIBRARIES: dict[str, tuple[str, ...]] = {
    "data": ("datasets", "transformers", "tokenizers"),
    "eval": ("torch", "transformers", "peft", "datasets"),
    "sft": ("torch", "transformers", "trl", "peft", "accelerate", "datasets"),
    "dpo": ("torch", "transformers", "trl", "peft", "accelerate", "datasets"),
    "grpo": ("torch", "transformers", "trl", "peft", "accelerate", "datasets"),
    "rft": ("torch", "transformers", "trl", "peft", "accelerate", "datasets"),
    "score": ("torch", "transformers", "peft", "datasets"),
}


@dataclass(frozen=True)
class CodeFingerprint:
    """What a step's code is: one hash per source file or library, and their combined digest."""

    files: Mapping[str, str] = field(default_factory=dict)

    @property
    def digest(self) -> str:
        blob = "\n".join(f"{k}={v}" for k, v in sorted(self.files.items()))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def changed(self, before: Mapping[str, str]) -> list[str]:
        """Names whose hash differs from ``before`` (added and removed ones included), sorted."""
        names = set(self.files) | set(before)
        return sorted(n for n in names if self.files.get(n) != before.get(n))


def _package_root() -> Path:
    return Path(posttrain.__file__).resolve().parent


def _module_file(name: str, root: Path) -> Path | None:
    """The source file of posttrain module ``name`` (package or module), without importing it."""
    parts = name.split(".")[1:]
    base = root.joinpath(*parts)
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imported_modules(file: Path, root: Path) -> set[str]:
    """posttrain modules named by any import in ``file`` (module level or inside functions)."""
    return set(_imports_in_source(file.read_text(encoding="utf-8"), str(file), root))


@cache
def _imports_in_source(source: str, filename: str, root: Path) -> frozenset[str]:
    """:func:`_imported_modules` of one source text, parsed once per process: the closures of the
    step kinds share most modules, and a cached rerun computes all five."""
    found: set[str] = set()
    for node in _statements(ast.parse(source, filename).body):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "posttrain")
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "posttrain":
            found.add(node.module)
            # `from posttrain.cache import keys` imports the submodule keys.
            found.update(
                f"{node.module}.{a.name}" for a in node.names if _module_file(f"{node.module}.{a.name}", root)
            )
    return frozenset(found)


def _statements(body: list[Any]) -> Iterator[Any]:
    """Every statement of ``body`` and of the blocks nested in it. Imports are statements, so the
    expressions (most of a tree's nodes) need no visit; ``except`` handlers and ``match`` cases are
    not statements but hold blocks."""
    for node in body:
        if isinstance(node, ast.stmt):
            yield node
        for block in ("body", "orelse", "finalbody", "handlers", "cases"):
            inner = getattr(node, block, None)
            if isinstance(inner, list):
                yield from _statements(inner)


def module_closure(
    entries: Sequence[str], root: Path | None = None, exclude: Sequence[str] = ()
) -> dict[str, Path]:
    """Every posttrain module ``entries`` import, transitively, by name → source file (modules
    under the packages in ``exclude`` left out)."""
    root = root or _package_root()
    seen: dict[str, Path] = {}
    todo = list(entries)
    while todo:
        name = todo.pop()
        if name in seen or name == "posttrain" or any(name == x or name.startswith(x + ".") for x in exclude):
            continue
        file = _module_file(name, root)
        if file is None:
            continue
        seen[name] = file
        todo.extend(_imported_modules(file, root) - set(seen))
    return dict(sorted(seen.items()))


@cache
def source_digest(source: str, filename: str = "<source>") -> str:
    """The hash of what ``source`` does: its syntax tree without docstrings (comments and layout
    are not in the tree), so that mending the words of a module does not rerun every step that
    imports it. A bare string statement does nothing, wherever it stands."""
    tree = ast.parse(source, filename)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            node.body = [s for s in body if not _is_bare_string(s)] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree).encode()).hexdigest()[:16]


def _is_bare_string(statement: Any) -> bool:
    return (
        isinstance(statement, ast.Expr)
        and isinstance(statement.value, ast.Constant)
        and isinstance(statement.value.value, str)
    )


@cache
def _kind_files(kind: str, root: Path | None = None) -> tuple[tuple[str, str], ...]:
    root = root or _package_root()
    files = {
        f"{name.replace('.', '/')}.py": source_digest(path.read_text(encoding="utf-8"), str(path))
        for name, path in module_closure(ENTRY_MODULES[kind], root, NOT_CALLED.get(kind, ())).items()
    }
    for module, name in STEP_SOURCES[kind]:
        files[f"{module.replace('.', '/')}.py:{name}"] = source_digest(_definition(module, name, root))
    files.update({f"lib:{k}": v for k, v in package_versions(LIBRARIES[kind]).items()})
    return tuple(sorted(files.items()))


def _definition(module: str, name: str, root: Path) -> str:
    """The source of top-level function or class ``name`` of posttrain module ``module``."""
    file = _module_file(module, root)
    assert file is not None, module
    source = file.read_text(encoding="utf-8")
    for node in ast.parse(source, str(file)).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name:
            return ast.get_source_segment(source, node) or ""
    raise KeyError(f"{module}:{name}")


def _custom_reward_files(reward_names: Sequence[str]) -> dict[str, str]:
    files = {}
    for name in sorted({n for n in reward_names if is_custom(n)}):
        module = name.partition(":")[0]
        if not custom_code_allowed():
            files[f"custom:{module}"] = "not-allowed"
            continue
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        origin = spec.origin if spec is not None else None
        files[f"custom:{module}"] = (
            sha256_file(Path(origin))[:16] if origin and Path(origin).is_file() else "?"
        )
    return files


def code_fingerprint(kind: str, reward_names: Sequence[str] = ()) -> CodeFingerprint:
    """The code a step of ``kind`` runs (module docstring); ``reward_names`` of GRPO/DPO stages."""
    return CodeFingerprint({**dict(_kind_files(kind)), **_custom_reward_files(reward_names)})
