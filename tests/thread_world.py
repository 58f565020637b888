"""Several ranks of one stage played by threads in one process, for tests of what the ranks must
decide alike (posttrain.training.zero_signal.Ranks): real processes are tests/system's business."""

from __future__ import annotations

import threading

import torch

from posttrain.training.zero_signal import Ranks, gather_batch


class ThreadWorld:
    """`count` ranks as threads in lockstep: each collective waits for every rank's part and hands
    every rank all parts in rank order, as accelerate's gather and gather_object do."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.parts: list = [None] * count
        self.barrier = threading.Barrier(count, timeout=20)  # a rank that skips a collective fails, not hangs

    def exchange(self, index: int, part):
        self.parts[index] = part
        self.barrier.wait()
        everything = list(self.parts)
        self.barrier.wait()
        return everything

    def widen(self, index: int, tensor, dim, pad_index, pad_first):
        width = max(self.exchange(index, tensor.shape[dim]))
        missing = width - tensor.shape[dim]
        return torch.nn.functional.pad(tensor, (missing, 0) if pad_first else (0, missing), value=pad_index)

    def ranks(self, index: int, pad_id: int = 0) -> Ranks:
        def gather(tensor):
            parts = self.exchange(index, tensor)
            return torch.cat([part if part.dim() else part[None] for part in parts])

        return Ranks(
            index=index,
            count=self.count,
            gather=gather,
            gather_list=lambda items: [x for part in self.exchange(index, list(items)) for x in part],
            gather_batch=lambda batch: gather_batch(
                batch, pad_id, lambda t, **kw: self.widen(index, t, **kw), gather
            ),
        )

    def run(self, rank) -> list:
        """``rank(index)`` on every rank at once; each rank's return value, in rank order."""
        results: list = [None] * self.count
        errors: list = []

        def call(index: int) -> None:
            try:
                results[index] = rank(index)
            except BaseException as exc:  # noqa: BLE001 - handed to the test below
                errors.append(exc)
                self.barrier.abort()  # the other ranks stop waiting for this one

        threads = [threading.Thread(target=call, args=(i,)) for i in range(self.count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        if errors:
            raise errors[0]
        return results
