"""Remembered file digests: a stat check stands in for re-hashing an unchanged file, never a changed one."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from posttrain.cache import digests
from posttrain.cache.digests import remembered_digests, sha256_file


@pytest.fixture
def reads(monkeypatch):
    """Files actually read to hash them (a remembered digest reads nothing)."""
    calls = []
    real = digests._stream_sha256

    def spy(path):
        calls.append(path.name)
        return real(path)

    monkeypatch.setattr(digests, "_stream_sha256", spy)
    return calls


@pytest.fixture
def weights(tmp_path, monkeypatch):
    """A file hashed once inside remembered_digests, its digest saved in ``memo.json``."""
    monkeypatch.setattr(digests, "SETTLE_NS", 0)  # the file was just written; see the racy-file test
    path = tmp_path / "model.safetensors"
    path.write_bytes(bytes(range(256)) * 64)
    with remembered_digests(tmp_path / "memo.json"):
        sha256_file(path)
    return path


def _real(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_an_unchanged_file_is_not_read_again(weights, reads):
    with remembered_digests(weights.parent / "memo.json"):
        assert sha256_file(weights) == _real(weights)
    assert reads == []


def test_a_flipped_byte_is_hashed_again_even_with_size_and_mtime_restored(weights, reads):
    before = weights.stat()
    with weights.open("r+b") as fh:  # in place: same inode, same size
        fh.seek(100)
        byte = fh.read(1)
        fh.seek(100)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights.stat().st_size == before.st_size and weights.stat().st_mtime_ns == before.st_mtime_ns
    with remembered_digests(weights.parent / "memo.json"):
        assert sha256_file(weights) == _real(weights)
    assert reads == ["model.safetensors"]


def test_a_touched_file_is_hashed_again_and_keeps_its_digest(weights, reads):
    digest = _real(weights)
    os.utime(weights)  # touch: content unchanged
    with remembered_digests(weights.parent / "memo.json"):
        assert sha256_file(weights) == digest
    assert reads == ["model.safetensors"]


def test_a_copy_is_hashed_again(weights, reads, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    os.replace(weights, copy / weights.name)  # another path
    with remembered_digests(tmp_path / "memo.json"):
        sha256_file(copy / weights.name)
    assert reads == ["model.safetensors"]


def test_a_file_changed_just_before_it_was_hashed_is_not_remembered(tmp_path, reads):
    """Timestamps are coarser than writes: a write in the same tick could leave the stat as it was."""
    path = tmp_path / "fresh.bin"
    path.write_bytes(b"x" * 1000)
    for _ in range(2):
        with remembered_digests(tmp_path / "memo.json"):
            sha256_file(path)
    assert reads == ["fresh.bin", "fresh.bin"]


def test_outside_the_block_nothing_is_remembered_and_a_bad_memo_is_ignored(weights, reads):
    sha256_file(weights)
    assert reads == ["model.safetensors"]
    memo = weights.parent / "memo.json"
    memo.write_text(json.dumps({"version": 1, "files": {str(weights.resolve()): "not a pair"}}))
    with remembered_digests(memo):
        assert sha256_file(weights) == _real(weights)
    assert reads == ["model.safetensors"] * 2
