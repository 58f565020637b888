"""A spy on the steps posttrain runs, in the test's process and in the worker processes it starts.

Each call of a step appends a ``start`` and an ``end`` line to ``<folder>/calls.jsonl`` (name, the
stage it is for, process id, ``time.monotonic()``, which is one clock for every process of the
machine). ``<folder>/hooks.json`` may make a call wait first until calls of another step have
started (it fails after ``timeout`` seconds), sleep, or fail.
"""

from __future__ import annotations

import importlib
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ENV = "POSTTRAIN_TEST_STEP_SPY"
TARGETS = {
    "prepare_step": ("posttrain.pipeline.steps", None),
    "eval_step": ("posttrain.pipeline.steps", None),
    "sft_step": ("posttrain.pipeline.plan", "SFTStep"),
    "dpo_step": ("posttrain.pipeline.plan", "DPOStep"),
    "grpo_step": ("posttrain.pipeline.plan", "GRPOStep"),
}
"""What each step runs, by the name tests count it under: a function of the steps module, or a
training step's ``train``."""


def install(folder: str | Path, setattr: Callable[[Any, str, Any], None] = setattr) -> None:
    """Wrap every target so that its calls are logged in ``folder`` and its hooks run."""
    for name, (module, cls) in TARGETS.items():
        owner = importlib.import_module(module)
        owner = getattr(owner, cls) if cls else owner
        attr = "train" if cls else name
        setattr(owner, attr, _spy(name, getattr(owner, attr), Path(folder)))


def _spy(name: str, real: Callable[..., Any], folder: Path) -> Callable[..., Any]:
    def spy(*args: Any, **kwargs: Any) -> Any:
        stage = args[1] if name == "eval_step" else getattr(args[0], "name", "data")
        _log(folder, {"event": "start", "name": name, "stage": stage})
        try:
            _run_hooks(folder, name, stage)
            return real(*args, **kwargs)
        finally:
            _log(folder, {"event": "end", "name": name, "stage": stage})

    return spy


def _log(folder: Path, line: dict[str, Any]) -> None:
    line = {**line, "pid": os.getpid(), "t": time.monotonic()}
    with (folder / "calls.jsonl").open("a", encoding="utf-8") as fh:  # one short append per line
        fh.write(json.dumps(line) + "\n")


def _read(folder: Path) -> list[dict[str, Any]]:
    path = folder / "calls.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _run_hooks(folder: Path, name: str, stage: str) -> None:
    path = folder / "hooks.json"
    hooks = json.loads(path.read_text()) if path.exists() else {}
    hook = hooks.get(f"{name}:{stage}", hooks.get(name))
    if not hook:
        return
    if wait_for := hook.get("wait_for"):
        other, count = wait_for
        deadline = time.monotonic() + hook.get("timeout", 180)
        while sum(c["event"] == "start" and c["name"] == other for c in _read(folder)) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"step spy: {name} waited in vain for {count} call(s) of {other}")
            time.sleep(0.1)
    time.sleep(hook.get("sleep", 0))
    if message := hook.get("fail"):
        raise RuntimeError(message)


class CallLog(Sequence[str]):
    """The names of the steps that started, in order, read from the folder each time."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    @property
    def calls(self) -> list[dict[str, Any]]:
        """Every start and end line, in order."""
        return _read(self.folder)

    def spans(self) -> list[tuple[str, int, float, float]]:
        """(``eval-<stage>`` or the step name, pid, start, end) of every finished call, by start."""
        starts: dict[tuple[str, str, int], float] = {}
        out = []
        for c in self.calls:
            key = (c["name"], c["stage"], c["pid"])
            if c["event"] == "start":
                starts[key] = c["t"]
            else:
                label = f"eval-{c['stage']}" if c["name"] == "eval_step" else c["name"].removesuffix("_step")
                out.append((label, c["pid"], starts.pop(key), c["t"]))
        return sorted(out, key=lambda s: s[2])

    def hook(self, target: str, **hook: Any) -> None:
        """Make calls of ``target`` (``eval_step:baseline``, ``sft_step``) wait, sleep or fail first."""
        path = self.folder / "hooks.json"
        hooks = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**hooks, target: hook}))

    def clear(self) -> None:
        (self.folder / "calls.jsonl").unlink(missing_ok=True)

    def _names(self) -> list[str]:
        return [c["name"] for c in self.calls if c["event"] == "start"]

    def __getitem__(self, index: Any) -> Any:
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __eq__(self, other: object) -> bool:
        return self._names() == list(other) if isinstance(other, Sequence) else NotImplemented

    def __repr__(self) -> str:
        return repr(self._names())
