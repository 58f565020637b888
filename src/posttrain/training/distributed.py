"""What a stage needs to know when several processes train it (``launch.launcher: accelerate``).

Every rank runs the whole stage function; the trainers (TRL's, through accelerate) shard the data
and average the gradients. What posttrain adds around them is done by rank 0 alone: readying the
working folder and writing the output (:func:`posttrain.training.stage_run.execute_stage`). The
process group is the one accelerate sets up from the launcher's environment (``WORLD_SIZE``,
``RANK``, ``MASTER_ADDR``/``MASTER_PORT``): gloo on a CPU, NCCL on GPUs.

``POSTTRAIN_RECORD_INPUTS=<folder>`` (tests and debugging only) makes each rank append a hash of
every sequence its training forward passes see to ``<folder>/rank<N>.jsonl``, which shows which
rank trained on what, and a GRPO stage's prompt-pool decisions at every step end to
``<folder>/pool-rank<N>.jsonl``, which shows whether the ranks kept one pool.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from posttrain.models.hardware import cuda_available

__all__ = [
    "RECORD_INPUTS_ENV",
    "barrier",
    "is_main_process",
    "rank",
    "record_inputs",
    "record_state",
    "sampler_ranks",
    "start",
    "world_size",
]

RECORD_INPUTS_ENV = "POSTTRAIN_RECORD_INPUTS"


def world_size() -> int:
    """Processes training this stage (``WORLD_SIZE`` from the launcher; 1 in process)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def is_main_process() -> bool:
    return rank() == 0


def start() -> None:
    """Join the process group now (accelerate's shared state; the trainer reuses it), so the stage
    can synchronise before its trainer exists. Nothing in a single process."""
    if world_size() > 1:
        from accelerate import PartialState  # heavy: deferred until needed

        PartialState(cpu=not cuda_available())


def barrier() -> None:
    """Wait for every rank (nothing in a single process)."""
    if world_size() > 1:
        import torch.distributed as dist  # heavy: deferred until needed

        dist.barrier()


def sampler_ranks(accelerator: Any, pad_id: int) -> Any:
    """The processes of ``accelerator`` as the dynamic sampler sees them
    (posttrain.training.zero_signal.Ranks): accelerate's collectives, identities in one process."""
    from functools import partial

    from accelerate.utils import gather_object  # heavy: deferred until needed

    from posttrain.training.zero_signal import Ranks, gather_batch

    if accelerator.num_processes == 1:
        return Ranks()
    return Ranks(
        index=accelerator.process_index,
        count=accelerator.num_processes,
        gather=accelerator.gather,
        gather_list=gather_object,
        gather_batch=partial(
            gather_batch, pad_id=pad_id, widen=accelerator.pad_across_processes, gather=accelerator.gather
        ),
    )


def record_inputs(model: Any) -> None:
    """With ``POSTTRAIN_RECORD_INPUTS`` set, log what each training forward of ``model`` sees
    (one JSON line per forward: this rank's sequence hashes, padding excluded)."""
    folder = os.environ.get(RECORD_INPUTS_ENV)
    if not folder:
        return
    import torch  # heavy: deferred until needed

    path = Path(folder) / f"rank{rank()}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)

    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or not torch.is_grad_enabled():  # generation and reference passes: no grad
            return
        mask = kwargs.get("attention_mask")
        rows = []
        for i, row in enumerate(ids.tolist()):
            keep = mask[i].tolist() if mask is not None else [1] * len(row)
            tokens = [t for t, m in zip(row, keep, strict=True) if m]
            rows.append(hashlib.sha256(json.dumps(tokens).encode()).hexdigest()[:16])
        with path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps({"rows": rows}) + "\n")

    model.register_forward_pre_hook(hook, with_kwargs=True)


def record_state(name: str, value: Any) -> None:
    """With ``POSTTRAIN_RECORD_INPUTS`` set, append ``value`` (JSON values) to
    ``<folder>/<name>-rank<N>.jsonl``."""
    folder = os.environ.get(RECORD_INPUTS_ENV)
    if not folder:
        return
    path = Path(folder) / f"{name}-rank{rank()}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as fh:
        fh.write(json.dumps(value, sort_keys=True) + "\n")
