"""Generation through a running vLLM server (``eval.backend: vllm_server``), over plain HTTP.

TRL 1.16's ``trl vllm-serve`` runs vLLM's own OpenAI-compatible server, and TRL's
``VLLMClient.generate`` posts token-id prompts to its ``/v1/completions`` with
``return_token_ids``. This module posts the same JSON fields itself instead of constructing
``VLLMClient``: that client's constructor raises ImportError unless vLLM is installed in the
calling process (it imports vLLM's NCCL weight-transfer helpers at module level), and it retries
a refused connection for half a minute, neither of which evaluation needs. Only the fields are
shared with TRL, so what the server sees is what a trainer's generation request looks like.

Sampling matches the other backends: plain temperature sampling (top-k/top-p off), greedy at
temperature 0, ``n`` samples per prompt, stopping on the same stop ids. vLLM seeds a request once,
so sampled completions depend on the seed but not per sample as the HF engine's do.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from typing import Any

from posttrain.core.errors import StageError
from posttrain.generation.engine import Completion, GenerationStats
from posttrain.generation.vllm_server import ServerAddress

logger = logging.getLogger(__name__)

__all__ = ["COMPLETIONS_PATH", "MODELS_PATH", "completion_request", "generate_via_server"]

COMPLETIONS_PATH = "/v1/completions"
"""Where TRL's ``VLLMClient.generate`` posts (trl 1.16)."""
MODELS_PATH = "/v1/models"
"""What ``VLLMClient`` reads the served model's name from (trl 1.16)."""
REQUEST_TIMEOUT_S = 3600.0
"""Per request: one chunk of prompts generated to the end on the server."""


def completion_request(
    model: str,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Iterable[int],
    samples: int,
    temperature: float,
    seed: int,
) -> dict[str, Any]:
    """The JSON body: ``VLLMClient.generate``'s fields (no logprobs) plus vLLM's ``stop_token_ids``
    and ``seed``, which that client would pass through ``generation_kwargs``.

    >>> body = completion_request("m", [[1, 2]], max_new_tokens=8, stop_ids=[2, 0], samples=1, temperature=0.0, seed=3)
    >>> body["prompt"], body["max_tokens"], body["stop_token_ids"], body["temperature"]
    ([[1, 2]], 8, [0, 2], 0.0)
    """
    return {
        "model": model,
        "prompt": [list(p) for p in prompts],
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "n": samples,
        "repetition_penalty": 1.0,
        "temperature": temperature,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        "max_tokens": max_new_tokens,
        "logprobs": None,
        "stop_token_ids": sorted(set(stop_ids)),
        "seed": seed,
    }


def generate_via_server(
    address: ServerAddress,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Iterable[int],
    samples: int = 1,
    temperature: float = 0.0,
    seed: int = 0,
    chunk: int = 256,
    timeout_s: float = REQUEST_TIMEOUT_S,
) -> tuple[list[list[Completion]], GenerationStats]:
    """``samples`` completions for each prompt (token ids), in prompt order, from the server.

    Prompts go in chunks of ``chunk`` (the server batches them itself; chunks bound one request's
    time and show progress in the log). A completion is ``finished`` unless the server says it
    stopped for length.
    """
    stop = sorted(set(stop_ids))
    model = _get(address, MODELS_PATH, timeout_s=30.0)["data"][0]["id"]
    results: list[list[Completion]] = []
    start = time.perf_counter()
    for first in range(0, len(prompts), chunk):
        part = prompts[first : first + chunk]
        body = completion_request(
            model,
            part,
            max_new_tokens=max_new_tokens,
            stop_ids=stop,
            samples=samples,
            temperature=temperature,
            seed=seed,
        )
        choices = sorted(
            _post(address, COMPLETIONS_PATH, body, timeout_s)["choices"], key=lambda c: c["index"]
        )
        if len(choices) != len(part) * samples:
            raise StageError(
                f"vllm_server: {address.base_url}{COMPLETIONS_PATH} returned {len(choices)} completions "
                f"for {len(part)} prompts x {samples} samples"
            )
        flat = [Completion(tuple(c["token_ids"]), c.get("finish_reason") != "length") for c in choices]
        results += [flat[i * samples : (i + 1) * samples] for i in range(len(part))]
        logger.info("vllm_server: %d/%d prompts generated", len(results), len(prompts))
    stats = GenerationStats(
        sequences=len(prompts) * samples,
        prompt_tokens=sum(len(p) for p in prompts) * samples,
        generated_tokens=sum(c.num_tokens for group in results for c in group),
        seconds=time.perf_counter() - start,
    )
    return results, stats


def _get(address: ServerAddress, path: str, *, timeout_s: float) -> dict[str, Any]:
    return _call(urllib.request.Request(f"{address.base_url}{path}"), timeout_s)


def _post(address: ServerAddress, path: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{address.base_url}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    return _call(request, timeout_s)


def _call(request: urllib.request.Request, timeout_s: float) -> dict[str, Any]:
    """The JSON answer; an HTTP error or an unreachable server is one StageError line."""
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - http://host:port
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace").replace("\n", " ")[:300]
        raise StageError(f"vllm_server: {request.full_url} answered {exc.code}: {detail}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise StageError(f"vllm_server: {request.full_url}: {exc}") from None
