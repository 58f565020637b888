"""The cache records of a store: Prefect's own result store over the store's ``results/`` folder.

The plan's :class:`~posttrain.pipeline.plan.Planner` reads records through this (``--dry-run``
included); the tasks write them, as Prefect persists each cached task's result under its key.
"""

from __future__ import annotations

from typing import Any

from prefect.filesystems import LocalFileSystem
from prefect.results import ResultStore

from posttrain.pipeline.store import Store

__all__ = ["PrefectRecords"]


class PrefectRecords:
    """:class:`~posttrain.pipeline.plan.CacheRecords` backed by Prefect's ``ResultStore``."""

    def __init__(self, store: Store) -> None:
        self._results = ResultStore(result_storage=LocalFileSystem(basepath=str(store.results_dir)))

    def exists(self, key: str) -> bool:
        return self._results.exists(key)

    def read(self, key: str) -> Any:
        return self._results.read(key).result
