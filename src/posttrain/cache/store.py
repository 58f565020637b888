"""The run store: where stage outputs, cache records and the embedded Prefect home live.

Layout (default ``./.posttrain``, `orchestration.store`)::

    .posttrain-store          marker: this folder is a posttrain store (posttrain cleans only these)
    lock                      held by the running pipeline (one writer per store; a sweep's points share it)
    locks/<key>               held while a step is decided and made (a sweep's concurrent points wait)
    data/<key>/               prepared train/eval datasets (datasets save_to_disk + stats.json)
    stages/<stage>-<key>/     model + tokenizer + stage.json, written atomically by the stage
    stages/<stage>-<key>.ckpt/  checkpoints of a stage not finished yet (resumed by the next run)
    evals/<stage>-<key>/      report.json + examples.jsonl
    results/<key>             one JSON cache record per key (posttrain.cache.records)
    prefect/                  PREFECT_HOME of the embedded (ephemeral) Prefect API

Each output directory is named after its step's cache key (:mod:`posttrain.cache.keys`).

``orchestration.store`` may point anywhere, and a run tidies what a killed run left (it deletes
``*.tmp-*`` folders and renames ``*.old-*`` ones), so posttrain only ever writes to a folder that
is marked as its store: a new or empty folder is marked when first used, and any other folder
without the marker is refused, even one that holds nothing but folders named like a store's.

A store stays inside itself: its folders (``data/``, ``stages/``, ...) and lock files must not be
symbolic links (such a store is refused, and tidying never follows one), and every path read back
from it is checked to lie inside it (:func:`posttrain.cache.records.path_outside`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from posttrain.core.atomic import CHECKPOINTS_SUFFIX, tidy_interrupted
from posttrain.core.errors import PosttrainError
from posttrain.core.inputs import file_in_the_way

logger = logging.getLogger(__name__)

__all__ = ["MARKER", "StepLock", "Store", "StoreError", "StoreLockedError"]


class StoreError(PosttrainError, RuntimeError):
    """A store that cannot be created or written (permissions, a file in the way, a full disk)."""


class StoreLockedError(StoreError):
    """Another pipeline run holds this store."""


MARKER = ".posttrain-store"
_AREAS = ("locks", "data", "stages", "scores", "evals", "results", "prefect")
"""The folders of a store (each must be a real folder inside it, never a symbolic link)."""

_HELD: set[Path] = set()
"""Stores whose lock this process holds: the CLI takes the lock before Prefect's server starts, and
the flow it then runs in this process re-enters it."""


@dataclass(frozen=True)
class Store:
    root: Path

    @classmethod
    def at(cls, path: str | Path, *, create: bool = True) -> Store:
        """The store at ``path``, created unless ``create`` is False (a dry run writes nothing)."""
        root = Path(path).expanduser().resolve()
        store = cls(root)
        if create:
            try:
                root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreError(f"cannot create the store {root}: {exc.strerror or exc}") from None
            store._mark()
            store.check_contained()
        return store

    @property
    def is_marked(self) -> bool:
        marker = self.root / MARKER
        return marker.is_file() and not marker.is_symlink()

    def check_usable(self) -> None:
        """What :meth:`at` would refuse, found without writing anything (a dry run creates no store):
        a file where the store or a folder above it would be, a folder that is not a store, a link."""
        if blocking := file_in_the_way(self.root):
            raise StoreError(f"{blocking} is not a folder")
        if self.root.is_dir():
            self._refuse_unmarked()
            self.check_contained()

    def _mark(self) -> None:
        """Mark a new or empty folder as a store; refuse any other folder without the marker."""
        if self.is_marked:
            return
        if not self.root.is_dir():
            raise StoreError(f"{self.root} is not a folder")
        self._refuse_unmarked()
        try:
            (self.root / MARKER).write_text(
                json.dumps({"posttrain_store": 1, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}) + "\n"
            )
        except OSError as exc:
            raise StoreError(f"cannot write to the store {self.root}: {exc.strerror or exc}") from None

    def _refuse_unmarked(self) -> None:
        if self.is_marked:
            return
        entries = sorted(p.name for p in self.root.iterdir())
        if entries:
            shown = ", ".join(entries[:3]) + (f" (+{len(entries) - 3} more)" if len(entries) > 3 else "")
            raise StoreError(
                f"{self.root} is not a posttrain store (no {MARKER} marker) and holds {shown}: "
                "point orchestration.store at a new or empty folder"
            )

    def check_contained(self) -> None:
        """Refuse a store whose folders or lock file are symbolic links: posttrain writes, renames
        and deletes inside its store, and a link would carry that to wherever it points."""
        for name in (*_AREAS, "lock"):
            if (self.root / name).is_symlink():
                raise StoreError(
                    f"{self.root / name} is a symbolic link: a store's folders must be real folders inside "
                    "it (posttrain writes and tidies only there); to keep a store on another disk, point "
                    "orchestration.store there"
                )

    def check_writable(self) -> None:
        """Fail now, in one line, if nothing can be written here (instead of after training)."""
        probe = self.root / f".write-test-{secrets.token_hex(4)}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise StoreError(f"cannot write to the store {self.root}: {exc.strerror or exc}") from None

    def data_dir(self, key: str) -> Path:
        return self.root / "data" / key[:12]

    def stage_dir(self, stage: str, key: str) -> Path:
        return self.root / "stages" / f"{stage}-{key[:12]}"

    def score_dir(self, stage: str, key: str) -> Path:
        return self.root / "scores" / f"{stage}-{key[:12]}"

    def eval_dir(self, stage: str, key: str) -> Path:
        return self.root / "evals" / f"{stage}-{key[:12]}"

    @property
    def results_dir(self) -> Path:
        return self.root / "results"

    @property
    def prefect_home(self) -> Path:
        return self.root / "prefect"

    def clean_interrupted_writes(self) -> list[Path]:
        """Tidy what a killed run left half-written (see :mod:`posttrain.core.atomic`).

        Call it while holding :meth:`lock`: then no other run can be writing, so every ``.tmp-``
        directory is the unfinished output of a run that died and an ``.old-`` one a complete
        previous output. Returns what was deleted or restored.
        """
        if not self.is_marked:
            raise StoreError(f"refusing to clean {self.root}: not a posttrain store (no {MARKER} marker)")
        self.check_contained()
        touched = [
            p for area in ("data", "stages", "scores", "evals") for p in tidy_interrupted(self.root / area)
        ]
        if touched:
            logger.warning(
                "cleaned %d leftover(s) of an interrupted run in %s: %s",
                len(touched),
                self.root,
                ", ".join(p.name for p in touched),
            )
        return touched

    def unfinished_checkpoints(self) -> list[Path]:
        """Checkpoint folders of stages that have not finished (after a whole run: of other configs)."""
        return sorted((self.root / "stages").glob(f"*{CHECKPOINTS_SUFFIX}"))

    @contextlib.contextmanager
    def lock(self, *, reentrant: bool = False) -> Iterator[None]:
        """Hold the store's lock for a pipeline run; a second concurrent run fails at once.

        flock is released by the kernel when the process dies, so a SIGKILLed run never leaves a
        stale lock behind. With ``reentrant``, a process that already holds this store's lock (the
        CLI, around the flow it runs) passes through; anyone else is refused as usual.
        """
        if reentrant and self.root in _HELD:
            yield
            return
        with self._flock():
            _HELD.add(self.root)
            try:
                yield
            finally:
                _HELD.discard(self.root)

    def step_lock(self, key: str) -> StepLock:
        """The lock of cache key ``key`` in this store (not yet taken)."""
        return StepLock(self.root / "locks" / key)

    @contextlib.contextmanager
    def _flock(self) -> Iterator[None]:
        path = self.root / "lock"
        try:
            handle = _open_lock_file(path)
        except OSError as exc:
            raise StoreError(f"cannot lock the store {self.root}: {exc.strerror or exc}") from None
        with handle as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                fh.seek(0)
                holder = fh.read().strip() or "unknown"
                raise StoreLockedError(
                    f"{self.root} is in use by another posttrain run (pid {holder})"
                ) from None
            fh.seek(0)
            fh.truncate()
            fh.write(str(os.getpid()))
            fh.flush()
            try:
                yield
            finally:
                fh.seek(0)
                fh.truncate()
                fcntl.flock(fh, fcntl.LOCK_UN)


def _open_lock_file(path: Path):
    """``path`` opened for appending and reading, never through a symbolic link (a planted link would
    make posttrain truncate and write whatever file it names)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o644)
    return os.fdopen(fd, "a+")


class StepLock:
    """One step's lock: held from the cache decision until the step's record is written, so runs
    sharing a store (a sweep's concurrent points) never make the same output at once; the second
    waits, then finds it cached. flock, like the store's lock: the kernel releases it when the
    process dies."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = None

    def acquire(self) -> StepLock:
        self.path.parent.mkdir(exist_ok=True)
        if self.path.parent.is_symlink():
            raise StoreError(f"{self.path.parent} is a symbolic link: refusing to lock through it")
        fh = _open_lock_file(self.path)
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES):
                fh.close()
                raise
            logger.info("%s: waiting for another run of this store to finish it", self.path.name)
            fcntl.flock(fh, fcntl.LOCK_EX)
        self._fh = fh
        return self

    def release(self) -> None:
        fh, self._fh = self._fh, None
        if fh is not None:
            fcntl.flock(fh, fcntl.LOCK_UN)
            fh.close()

    def __enter__(self) -> StepLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()
