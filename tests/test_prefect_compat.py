"""Prefect's private hook (flows/prefect_compat.py) is pinned: a Prefect outside the checked range,
or a server singleton of another shape, fails here before it fails a run."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from posttrain.flows import prefect_compat

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_installed_prefect_is_inside_the_checked_range():
    checked = SpecifierSet(",".join(prefect_compat.PREFECT_VERSIONS))
    assert metadata.version("prefect") in checked
    pins = [Requirement(r) for r in tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]]
    assert next(r.specifier for r in pins if r.name == "prefect") == checked  # pyproject pins the same


def test_embedded_server_singleton_has_the_shape_posttrain_uses():
    from prefect.server.api.server import SubprocessASGIServer

    assert SubprocessASGIServer() is SubprocessASGIServer()  # one per process: the flow finds ours
    server = SubprocessASGIServer()
    assert callable(server.start) and hasattr(server, "server_process")
