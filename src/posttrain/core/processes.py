"""Stopping a child process tree: a launched stage's ranks, a generation server's workers.

posttrain starts such children with ``start_new_session=True``, so each is the leader of its own
process group and everything it forks (torchrun's ranks, vLLM's engine processes) is in that group.
Stopping the leader alone would leave those running and holding GPUs; the group is signalled.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess

__all__ = ["stop_process_group"]


def stop_process_group(proc: subprocess.Popen, grace_s: float = 10.0) -> int | None:
    """SIGTERM ``proc``'s process group, wait ``grace_s`` for the leader, then SIGKILL what is left of
    the group (members that outlive their leader included); return the leader's exit code.

    ``proc`` must have been started with ``start_new_session=True`` (its pid is the group id).
    """
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers; ProcessLookupError once the group is empty
    try:
        return proc.wait(timeout=5)
    except subprocess.TimeoutExpired:  # unkillable (uninterruptible sleep): nothing more to do here
        return None
