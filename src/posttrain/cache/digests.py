"""File digests for checking outputs: a streamed sha256 per file, a content hash per folder, and
the memo that spares re-hashing unchanged files.

Checking that a cached output is intact re-hashes it, which for a model is
seconds per stage on every rerun. Inside :func:`remembered_digests` each file's sha256 is kept with
its stat (size, mtime and ctime in ns, inode, device) and reused while the stat is unchanged. Any
write changes mtime and ctime, and nothing but the kernel sets ctime, so a file rewritten in place
with the same size, even with its mtime put back, is hashed again; so is a touched one (and a
copy: new inode). As git does for its index ("racy git"), a digest is only remembered for a file
last changed more than :data:`SETTLE_NS` before it was hashed, because timestamps are coarser than
the writes that could follow within the same tick.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import json
import os
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

from posttrain.core.untrusted import UntrustedContentError, note_unreadable, read_json_bounded

__all__ = ["SETTLE_NS", "fingerprint_tree", "remembered_digests", "sha256_file"]


SETTLE_NS = 2_000_000_000
"""A file changed less than this before it was hashed gets no remembered digest (module docstring)."""
_MEMO_VERSION = 1


class _DigestMemo:
    """Path -> (stat signature, sha256), read from and written to one JSON file."""

    def __init__(self, path: Path | None) -> None:
        self.path, self.entries, self.changed = path, {}, False
        if path is not None:
            self.entries = _read_memo(path)

    def digest(self, file: Path) -> str:
        key = str(file.resolve())
        before = _signature(file)
        entry = self.entries.get(key)
        if entry is not None and entry[0] == before:
            return entry[1]
        digest = _stream_sha256(file)
        # The signature from before reading: a write during the read changes the file's stat, so
        # the next lookup misses and hashes again.
        if time.time_ns() - max(before[1], before[2]) > SETTLE_NS:
            self.entries[key] = [before, digest]
            self.changed = True
        return digest

    def save(self) -> None:
        """Write the memo atomically, without entries whose file is gone."""
        if self.path is None or not self.changed:
            return
        files = {k: v for k, v in self.entries.items() if os.path.exists(k)}
        tmp = self.path.with_name(f".{self.path.name}.tmp-{secrets.token_hex(4)}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"version": _MEMO_VERSION, "files": files}))
            os.replace(tmp, self.path)
        except OSError:  # a memo that cannot be written costs a re-hash next time, nothing else
            with contextlib.suppress(OSError):
                tmp.unlink()


def _read_memo(path: Path) -> dict[str, list]:
    """The remembered entries of a digest memo; a damaged memo (store content, untrusted) is empty,
    noted once: every file is hashed again, nothing else."""
    try:
        data = read_json_bounded(path, max_bytes=64 << 20, max_depth=8, expect=dict)
        files = data.get("files") if data.get("version") == _MEMO_VERSION else {}
        if not isinstance(files, dict):
            raise UntrustedContentError(f"{path}: files must be a mapping")
    except FileNotFoundError:
        return {}
    except UntrustedContentError as exc:
        note_unreadable(exc, "hashing every file again")
        return {}
    return {
        str(k): v
        for k, v in files.items()
        if isinstance(v, list)
        and len(v) == 2
        and isinstance(v[1], str)
        and isinstance(v[0], list)
        and all(type(n) is int for n in v[0])
    }


def _signature(file: Path) -> list[int]:
    st = file.stat()
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


_MEMO: contextvars.ContextVar[_DigestMemo | None] = contextvars.ContextVar("posttrain_digests", default=None)


@contextlib.contextmanager
def remembered_digests(memo_file: str | Path | None, *, save: bool = True) -> Iterator[None]:
    """Within the block, :func:`sha256_file` reuses the digests remembered in ``memo_file`` for files
    whose stat is unchanged (module docstring), and remembers new ones (written at the end when
    ``save``; a dry run reads only)."""
    memo = _DigestMemo(Path(memo_file) if memo_file is not None else None)
    token = _MEMO.set(memo)
    try:
        yield
    finally:
        _MEMO.reset(token)
        if save:
            memo.save()


def _stream_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    """Streamed sha256 of a file (models are hundreds of MB); inside :func:`remembered_digests`, the
    remembered one while the file's stat is unchanged."""
    memo = _MEMO.get()
    return memo.digest(Path(path)) if memo is not None else _stream_sha256(Path(path))


def fingerprint_tree(path: str | Path) -> str:
    """Content hash of every file under ``path`` (relative name, size, sha256; 16 hex characters).

    Skips hidden files and the ``cache-*.arrow`` files ``datasets`` adds next to a dataset loaded
    from disk when it is filtered or mapped: they are derived, not content.
    """
    root = Path(path)
    digest = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = file.relative_to(root)
        if any(part.startswith(".") for part in rel.parts) or (
            rel.name.startswith("cache-") and rel.suffix == ".arrow"
        ):
            continue
        digest.update(f"{rel.as_posix()}\0{file.stat().st_size}\0".encode())
        digest.update(sha256_file(file).encode())
    return digest.hexdigest()[:16]
