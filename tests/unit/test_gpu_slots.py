"""Setting the Prefect server's ``gpu`` tag limit when two runs start together."""

from __future__ import annotations

import httpx
import pytest
from prefect.exceptions import PrefectHTTPStatusError

from posttrain.flows import pipeline_flow


class RacingClient:
    """A client whose first create loses the server's read-then-insert race (409), as a second run's does."""

    def __init__(self, first_status: int):
        self.first_status, self.calls = first_status, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def create_concurrency_limit(self, tag, concurrency_limit):
        self.calls.append((tag, concurrency_limit))
        if len(self.calls) == 1 and self.first_status:
            request = httpx.Request("POST", "http://127.0.0.1/api/concurrency_limits/")
            response = httpx.Response(self.first_status, request=request)
            raise PrefectHTTPStatusError("conflict", request=request, response=response)


@pytest.fixture
def client(monkeypatch, request):
    fake = RacingClient(request.param)
    monkeypatch.setattr("prefect.client.orchestration.get_client", lambda sync_client: fake)
    return fake


@pytest.mark.parametrize("client", [0, 409], indirect=True)
def test_the_limit_is_set_even_when_another_run_created_it_first(client):
    pipeline_flow.set_gpu_slots(1)
    assert client.calls[-1] == (pipeline_flow.GPU_TAG, 1)
    assert len(client.calls) == (2 if client.first_status else 1)


@pytest.mark.parametrize("client", [500], indirect=True)
def test_other_server_errors_are_not_retried(client):
    with pytest.raises(PrefectHTTPStatusError):
        pipeline_flow.set_gpu_slots(1)
    assert len(client.calls) == 1
