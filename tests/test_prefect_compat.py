"""Prefect's embedded server: started early for a run (flows/server.py), through the one private hook
(flows/prefect_compat.py), which is pinned: a Prefect outside the checked range, or a server
singleton of another shape, fails here before it fails a run."""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from posttrain.flows import prefect_compat
from posttrain.pipeline.store import Store


def test_installed_prefect_is_inside_the_checked_range():
    checked = SpecifierSet(",".join(prefect_compat.PREFECT_VERSIONS))
    assert metadata.version("prefect") in checked
    pins = [Requirement(r) for r in metadata.requires("posttrain")]
    assert next(r.specifier for r in pins if r.name == "prefect") == checked  # pyproject pins the same


def test_embedded_server_singleton_has_the_shape_posttrain_uses():
    from prefect.server.api.server import SubprocessASGIServer

    assert SubprocessASGIServer() is SubprocessASGIServer()  # one per process: the flow finds ours
    server = SubprocessASGIServer()
    assert callable(server.start) and hasattr(server, "server_process")


def test_prestart_leaves_a_configured_server_alone(tmp_path, monkeypatch):
    from posttrain.flows.server import prestart_embedded_prefect

    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:1/api")
    assert prestart_embedded_prefect(Store.at(tmp_path)) is None


def test_prestart_starts_the_server_the_flow_client_then_uses(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.server.api.server import SubprocessASGIServer

    from posttrain.flows.server import prestart_embedded_prefect

    early = prestart_embedded_prefect(Store.at(tmp_path))
    assert early is not None
    early.wait()
    server = SubprocessASGIServer()
    assert server.running and server.server_process is not None
    with get_client(sync_client=True) as client:
        assert str(client.api_url).rstrip("/") == server.api_url.rstrip("/")
        assert client.api_healthcheck() is None  # None means healthy


def test_import_embedded_server_defines_every_orm_model_before_the_server_thread_starts():
    """The early server's thread must not be defining Prefect's ORM classes while MLflow's SQL store
    configures every SQLAlchemy mapper in the main thread (a 1-in-5 crash on a loaded machine)."""
    from sqlalchemy.orm import configure_mappers

    prefect_compat.import_embedded_server()
    orm = sys.modules["prefect.server.database.orm_models"]
    assert hasattr(orm, "FlowRun") and hasattr(orm, "Flow")
    configure_mappers()  # what MLflow's store triggers; raises on a half-defined model
