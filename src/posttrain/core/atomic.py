"""The atomic-output protocol: an output directory is either absent, the old one, or the new one.

A step writes into ``<name>.tmp-<hex>`` next to its final path. At the end the previous output (if
any) is moved aside as ``<name>.old-<hex>``, the new one is renamed into place and the old one is
deleted. A kill at any instant therefore leaves one of three things: a ``.tmp-`` directory (an
unfinished output, to delete), an ``.old-`` directory whose final path is missing (the kill fell
between the two renames: put it back), or an ``.old-`` directory next to its replacement (delete).
:func:`staging_dir` writes by this protocol; :func:`tidy_interrupted` undoes what a kill left.

Two more names belong to the protocol:

* ``<name>.ckpt/`` (:func:`checkpoints_dir`) is where a training stage works: its trainer's
  checkpoints and whatever the trainer writes along the way. Unlike ``.tmp-`` it survives a kill,
  so the next run of the same step resumes from the last checkpoint; it is removed once the
  output is in place.
* ``<name>/.result.json`` (:data:`RESULT_FILE`) is the step's result, written into the staging
  directory just before the rename. An output renamed into place whose cache record was never
  written (a kill between the two) carries its own result, so the next run can verify it and
  adopt it instead of recomputing it. Hidden files are outside every output fingerprint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "CHECKPOINTS_SUFFIX",
    "REPLACED_SUFFIX",
    "RESULT_FILE",
    "STAGING_SUFFIX",
    "checkpoints_dir",
    "discard_checkpoints",
    "replace_dir",
    "staging_dir",
    "tidy_interrupted",
    "write_result",
]

STAGING_SUFFIX = ".tmp-"
REPLACED_SUFFIX = ".old-"
CHECKPOINTS_SUFFIX = ".ckpt"
RESULT_FILE = ".result.json"


def checkpoints_dir(output_dir: str | Path) -> Path:
    """The durable working folder of the step that writes ``output_dir`` (its checkpoints).

    >>> checkpoints_dir("/store/stages/sft-0123456789ab").as_posix()
    '/store/stages/sft-0123456789ab.ckpt'
    """
    final = Path(output_dir).resolve()
    return final.with_name(final.name + CHECKPOINTS_SUFFIX)


def discard_checkpoints(output_dir: str | Path) -> bool:
    """Delete the checkpoints of the step that writes ``output_dir``; True if there were any."""
    folder = checkpoints_dir(output_dir)
    if not folder.exists():
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return True


def write_result(directory: Path, result: Any) -> None:
    """Write a step's result (a dataclass) as :data:`RESULT_FILE` into its staging ``directory``."""
    data = dataclasses.asdict(result)
    (directory / RESULT_FILE).write_text(json.dumps(data, indent=1, sort_keys=True, default=str))


@contextlib.contextmanager
def staging_dir(output_dir: str | Path) -> Iterator[Path]:
    """Yield a fresh temporary directory that replaces ``output_dir`` only if the block succeeds.

    The old output (a previous run of the same step) is moved aside before the rename and deleted
    after it, so at every instant ``output_dir`` is either the old complete output or the new one.
    """
    final = Path(output_dir).resolve()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}{STAGING_SUFFIX}{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, final)


def replace_dir(new: Path, final: Path) -> None:
    """Rename the finished directory ``new`` to ``final``, moving an existing ``final`` aside first
    and deleting it after, so ``final`` is at every instant the old complete directory or the new one."""
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}{REPLACED_SUFFIX}{secrets.token_hex(4)}")
        final.rename(old)
    new.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def tidy_interrupted(folder: Path) -> list[Path]:
    """Delete unfinished outputs and restore interrupted replacements directly under ``folder``.

    Only safe while no other process writes there (the caller holds the store's lock). Symbolic
    links (``folder`` itself, or an entry in it) are never followed: posttrain writes none. Returns
    the paths deleted or restored.
    """
    touched = []
    if not folder.is_dir() or folder.is_symlink():
        return touched
    for path in sorted(folder.iterdir()):
        name = path.name
        if path.is_symlink():  # never ours: following it would delete or rename outside the store
            continue
        if STAGING_SUFFIX in name:
            shutil.rmtree(path, ignore_errors=True)
        elif REPLACED_SUFFIX in name:
            final = path.with_name(name.split(REPLACED_SUFFIX)[0])
            if final.exists():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.rename(final)
                logger.warning("restored %s from an interrupted replacement", final)
        else:
            continue
        touched.append(path)
    return touched
