"""The atomic-output protocol: an output directory is either absent, the old one, or the new one.

A step writes into ``<name>.tmp-<hex>`` next to its final path. At the end the previous output (if
any) is moved aside as ``<name>.old-<hex>``, the new one is renamed into place and the old one is
deleted. A kill at any instant therefore leaves one of three things: a ``.tmp-`` directory (an
unfinished output, to delete), an ``.old-`` directory whose final path is missing (the kill fell
between the two renames: put it back), or an ``.old-`` directory next to its replacement (delete).
:func:`staging_dir` writes by this protocol; :func:`tidy_interrupted` undoes what a kill left.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["REPLACED_SUFFIX", "STAGING_SUFFIX", "staging_dir", "tidy_interrupted"]

STAGING_SUFFIX = ".tmp-"
REPLACED_SUFFIX = ".old-"


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
    old = None
    if final.exists():
        old = final.with_name(f"{final.name}{REPLACED_SUFFIX}{secrets.token_hex(4)}")
        final.rename(old)
    tmp.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def tidy_interrupted(folder: Path) -> list[Path]:
    """Delete unfinished outputs and restore interrupted replacements directly under ``folder``.

    Only safe while no other process writes there (the caller holds the store's lock). Returns the
    paths deleted or restored.
    """
    touched = []
    if not folder.is_dir():
        return touched
    for path in sorted(folder.iterdir()):
        name = path.name
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
