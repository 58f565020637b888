"""Prefect's embedded server: started early for a run (flows/server.py), through the one private hook
(flows/prefect_compat.py), which is pinned: a Prefect outside the checked range, or a server
singleton of another shape, fails here before it fails a run."""

from __future__ import annotations

import os
import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from posttrain.cache.store import Store
from posttrain.flows import prefect_compat


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


def test_posttrain_runs_prefects_own_uvicorn_command_under_the_watchdog(monkeypatch):
    """The server command posttrain starts is Prefect's, argument for argument and variable for
    variable, with `-m uvicorn` run through the watchdog instead, in a session of its own."""
    import subprocess

    from prefect.server.api.server import SubprocessASGIServer

    started = []

    class Recorded:
        def __init__(self, args, **kwargs):
            started.append((args, kwargs))

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    server = SubprocessASGIServer(port=1)  # its own singleton slot: never started
    try:
        original = prefect_compat._REPLACED.get(  # installed by an earlier start, or not yet
            "_run_uvicorn_command", SubprocessASGIServer.__dict__["_run_uvicorn_command"]
        )
        original(server)
        prefect_compat.uvicorn_dying_with_parent(server)
    finally:
        SubprocessASGIServer._instances.pop(1, None)
    (theirs, their_kwargs), (ours, our_kwargs) = started
    assert theirs[1:3] == ["-m", "uvicorn"]
    assert ours[:5] == [theirs[0], "-c", prefect_compat.WATCHDOG, str(os.getpid()), "uvicorn"]
    assert ours[5:] == theirs[3:] and our_kwargs == {**their_kwargs, "start_new_session": True}


def test_the_watchdog_ends_its_process_when_the_parent_is_killed(tmp_path):
    """A parent starts `python -m http.server` under the watchdog and is SIGKILLed: the child ends."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', sys.argv[1], str(__import__('os').getpid()),"
            " 'http.server', '0', '--bind', '127.0.0.1'])\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(600)\n",
            prefect_compat.WATCHDOG,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = psutil.Process(int(parent.stdout.readline()))
    try:
        time.sleep(1)  # the child is up and watching
        assert child.is_running() and child.status() != psutil.STATUS_ZOMBIE
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.1)
        assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    finally:  # a failing watchdog must not leave its child behind
        parent.kill()
        if child.is_running():
            child.kill()


def test_run_config_keeps_secrets_out_of_prefects_parameters():
    from posttrain.flows.pipeline_flow import run_config

    stored = run_config.serialize_parameters(
        {
            "config": "configs/smoke.yaml",
            "overrides": [
                "seed=1",
                "grpo.stages.0.rewards.0.params.api_key=PLANTED",
                "tracking.tracking_uri=http://bob:PLANTED@mlflow.local",
                "grpo.stages.0.rewards.0.params={token: PLANTED, n: 2}",
            ],
            "force": None,
        }
    )
    assert "PLANTED" not in str(stored)
    assert stored["overrides"][0] == "seed=1" and stored["config"] == "configs/smoke.yaml"


def test_a_flow_run_created_with_secrets_has_them_replaced_as_it_starts():
    """A deployment's run is created by whoever triggers it, with raw parameters: the flow
    overwrites them (here a flow without posttrain's own serializer stands in for that caller)."""
    from prefect import flow, get_client
    from prefect.context import FlowRunContext

    from posttrain.flows.pipeline_flow import redact_run_parameters

    @flow
    def triggered(config: str, overrides: list[str]) -> str:
        assert prefect_compat.redact_stored_parameters(redact_run_parameters)
        assert overrides == ["a.password=PLANTED"]  # the flow itself still has the real value
        return str(FlowRunContext.get().flow_run.id)

    run_id = triggered("x.yaml", ["a.password=PLANTED"])
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(run_id).parameters == {
            "config": "x.yaml",
            "overrides": ["a.password=***"],
        }


def test_prefect_yaml_is_valid_for_prefect_and_queues_runs_of_a_deployment():
    """`prefect deploy` reads prefect.yaml through this (private) model; a run that arrives while the
    previous one of its deployment still holds the store's lock waits (ENQUEUE) instead of failing."""
    from pathlib import Path

    import yaml
    from prefect.cli.deploy._models import PrefectYamlModel  # private: pinned with PREFECT_VERSIONS

    spec = Path(__file__).resolve().parents[2] / "prefect.yaml"
    model = PrefectYamlModel.model_validate(yaml.safe_load(spec.read_text()))
    assert model.deployments
    for deployment in model.deployments:
        limit = deployment.concurrency_limit
        assert (limit.limit, limit.collision_strategy) == (1, "ENQUEUE"), deployment.name


KUBERNETES_TEMPLATE = "configs/prefect/kubernetes-gpu-job-template.json"


def test_kubernetes_gpu_template_is_prefect_kubernetes_default_plus_the_gpu_request():
    """The GPU pool's base job template is prefect-kubernetes' own default with exactly one variable
    (`gpu`), its `nvidia.com/gpu` limit and a toleration added: an upgrade that changes the default
    shows up here, and the server accepts the template (its own WorkPoolCreate model checks that
    every placeholder is a declared variable)."""
    import json
    from pathlib import Path

    from prefect.server.schemas.actions import WorkPoolCreate
    from prefect_kubernetes.worker import KubernetesWorker

    template = json.loads((Path(__file__).resolve().parents[2] / KUBERNETES_TEMPLATE).read_text())
    ours = json.loads(json.dumps(template))
    assert ours["variables"]["properties"].pop("gpu")["type"] == "integer"
    pod = ours["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"].pop("nvidia.com/gpu") == "{{ gpu }}"
    assert pod.pop("tolerations") == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert ours == json.loads(json.dumps(KubernetesWorker.get_default_base_job_template()))
    WorkPoolCreate(name="posttrain-k8s-gpu", type="kubernetes", base_job_template=template)


def test_kubernetes_deployment_job_variables_render_a_job_requesting_gpus():
    """prefect.yaml's Kubernetes deployment: its job variables pass the checks the server runs on a
    deployment (prefect.server.api.validation), and the kubernetes worker's own job configuration
    renders them into a Job whose container requests `nvidia.com/gpu`."""
    import asyncio
    import json
    from pathlib import Path

    import pytest
    import yaml
    from prefect.utilities.schema_tools import ValidationError, is_valid_schema, validate
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    repo = Path(__file__).resolve().parents[2]
    template = json.loads((repo / KUBERNETES_TEMPLATE).read_text())
    spec = yaml.safe_load((repo / "prefect.yaml").read_text())
    (gpu,) = [d for d in spec["deployments"] if d["work_pool"]["name"] == "posttrain-k8s-gpu"]
    job_variables = {**gpu["work_pool"]["job_variables"], "image": "registry.example.com/posttrain:1"}
    schema = template["variables"]
    is_valid_schema(schema, preprocess=False)
    validate(job_variables, schema, raise_on_error=True, preprocess=True, ignore_required=True)
    with pytest.raises(ValidationError):  # the schema is strict enough to catch a wrong type
        validate({**job_variables, "gpu": "one"}, schema, raise_on_error=True, ignore_required=True)

    # client=object(): no block or variable references, so nothing reaches an API
    job = asyncio.run(
        KubernetesWorkerJobConfiguration.from_template_and_values(template, job_variables, client=object())
    )
    (container,) = job.job_manifest["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["limits"] == {"nvidia.com/gpu": 1}
    assert container["image"] == "registry.example.com/posttrain:1"
    two = asyncio.run(
        KubernetesWorkerJobConfiguration.from_template_and_values(
            template, {**job_variables, "gpu": 2}, client=object()
        )
    )
    assert (
        two.job_manifest["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
        == 2
    )
    assert gpu["pull"][0]["prefect.deployments.steps.set_working_directory"]["directory"] == "/opt/posttrain"
