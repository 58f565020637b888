"""A managed vLLM generation server (``vllm_server:``): ``vllm serve`` as TRL's trainers expect it, for one
GRPO stage.

In TRL's server mode (``use_vllm: true, vllm_mode: server``) the trainer generates through an HTTP
server on GPUs of its own and pushes its weights into it (NCCL) before each generation step. TRL
leaves starting that server to the user; :func:`vllm_server` does it for a stage:

1. refuse a port something already answers on (the health check would pass against it);
2. start ``vllm serve M --host H --port P ...`` with the flags TRL's trainers rely on (weight transfer,
   processed logprobs: TRL's own ``build_command``, which the deprecated ``trl vllm-serve`` runs too)
   and ``VLLM_SERVER_DEV_MODE=1`` (the weight-transfer endpoints live behind it), in its own process
   group, with ``CUDA_VISIBLE_DEVICES`` set to the configured GPUs and its output in a log file;
3. poll ``http://H:P/health`` (what TRL's ``VLLMClient.check_server`` polls) until it answers 200,
   failing with one line and the log's last lines if the server exits first or takes longer than
   ``timeout_s``;
4. yield the address for the trainer's ``vllm_server_host``/``vllm_server_port``;
5. on leaving, however it is left, SIGTERM the whole group and SIGKILL what remains after a grace
   period (vLLM's engine and worker processes are children of the server).

The server loads the stage's input model (for an adapter output, the full model under it): TRL
pushes the policy's weights before the first generation, so what it loaded only fixes the
architecture and the tokenizer. The command is a parameter so tests run a tiny stand-in server.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.util
import logging
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from posttrain.core.config import VLLMServerConfig
from posttrain.core.errors import HardwareError, StageError
from posttrain.core.processes import stop_process_group
from posttrain.models.hardware import cuda_available

logger = logging.getLogger(__name__)

__all__ = [
    "HEALTH_PATH",
    "ServerAddress",
    "check_vllm_server",
    "serve_command",
    "vllm_server",
]

HEALTH_PATH = "/health"
"""vLLM's health endpoint, the one TRL's ``VLLMClient.check_server`` polls (trl 1.16)."""
GRACE_S = 15.0
"""Between SIGTERM and SIGKILL: vLLM shuts its engine processes down in a few seconds."""
_POLL_S = 1.0
_TAIL_LINES = 8


@dataclass(frozen=True)
class ServerAddress:
    """Where a running server answers."""

    host: str
    port: int

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def trainer_options(self) -> dict[str, object]:
        """The GRPOConfig options that point TRL's server mode here."""
        return {"vllm_server_host": self.host, "vllm_server_port": self.port}


def check_vllm_server() -> None:
    """Raise :class:`HardwareError` (one line) unless ``vllm serve`` can run here: CUDA and vLLM."""
    if not cuda_available():
        raise HardwareError(
            "vllm_server: a managed vLLM server needs a CUDA GPU and this machine has none; "
            "remove vllm_server (and the stages' use_vllm, eval.backend: vllm_server) to run on a CPU"
        )
    if importlib.util.find_spec("vllm") is None:
        raise HardwareError("vllm_server: vLLM is not installed: pip install 'posttrain[vllm]'")


def serve_command(cfg: VLLMServerConfig, model: str, *, revision: str | None = None) -> list[str]:
    """The ``vllm serve`` command line for ``model``, built by TRL's own ``build_command`` from
    ``trl vllm-serve``'s options (``extra_args`` keep that vocabulary; flags it does not know are
    forwarded to ``vllm serve``), run with this interpreter so the server uses the same vLLM.

    >>> cfg = VLLMServerConfig(gpus=[1, 2], port=8001, extra_args=["--gpu_memory_utilization", "0.8"])
    >>> cmd = serve_command(cfg, "Qwen/Qwen2.5-0.5B-Instruct")
    >>> cmd[1:8]
    ['-m', 'vllm.entrypoints.cli.main', 'serve', 'Qwen/Qwen2.5-0.5B-Instruct', '--host', '127.0.0.1', '--port']
    >>> cmd[cmd.index("--tensor-parallel-size") + 1], cmd[cmd.index("--gpu-memory-utilization") + 1]
    ('2', '0.8')
    """
    from trl.scripts.utils import TrlParser
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    args = ["--model", model, "--host", cfg.host, "--port", str(cfg.port)]
    if revision is not None:
        args += ["--revision", revision]
    flags = {arg.split("=", 1)[0].replace("-", "_") for arg in cfg.extra_args}
    if len(cfg.gpus) > 1 and not flags & {"__tensor_parallel_size", "__data_parallel_size"}:
        args += ["--tensor_parallel_size", str(len(cfg.gpus))]
    # The flags were checked against the allow list (posttrain.core.library_policy) at validation;
    # TRL's parser reads them as `trl vllm-serve` would, and what it does not know goes to vLLM.
    script_args, forwarded = TrlParser(ScriptArguments).parse_args_into_dataclasses(
        args + list(cfg.extra_args), return_remaining_strings=True
    )
    return build_command(script_args, forwarded)


@contextlib.contextmanager
def vllm_server(
    cfg: VLLMServerConfig,
    model: str,
    log_path: str | Path,
    *,
    revision: str | None = None,
    command: Sequence[str] | None = None,
    grace_s: float = GRACE_S,
) -> Iterator[ServerAddress]:
    """Run a vLLM server for ``model`` on ``cfg.gpus`` while the block runs; yield its address.

    ``command`` replaces ``vllm serve`` (and the CUDA/vLLM check), for tests; it must serve
    ``cfg.host:cfg.port``. The server's output goes to ``log_path`` (appended).
    """
    if command is None:
        check_vllm_server()
        command = serve_command(cfg, model, revision=revision)
    address = ServerAddress(cfg.host, cfg.port)
    if _answers(address):
        raise StageError(
            f"vllm_server: something already listens on {address.host}:{address.port}; "
            "stop it or choose another vllm_server.port"
        )
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in cfg.gpus),
        "VLLM_SERVER_DEV_MODE": "1",  # TRL's weight-transfer endpoints are dev-mode routes of vLLM's server
    }
    logger.info(
        "vllm_server: starting on GPU(s) %s: %s (log %s)",
        env["CUDA_VISIBLE_DEVICES"],
        " ".join(command),
        log_path,
    )
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(  # noqa: S603 - our own interpreter and vLLM's CLI (or a test's), no shell
            list(command),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: stopped as a whole, vLLM's workers included
        )
        try:
            _wait_healthy(proc, address, cfg.timeout_s, log_path)
            yield address
        finally:
            code = stop_process_group(proc, grace_s)
            logger.info("vllm_server: stopped (exit code %s)", code)


def _wait_healthy(proc: subprocess.Popen, address: ServerAddress, timeout_s: float, log_path: Path) -> None:
    """Return once the server answers its health check; raise StageError if it exits or times out."""
    start = time.monotonic()
    while True:
        code = proc.poll()
        if code is not None:
            raise StageError(
                f"vllm_server: the server exited with code {code} before answering "
                f"{address.base_url}{HEALTH_PATH}; last lines of {log_path}: {_tail(log_path)}"
            )
        if _healthy(address):
            logger.info("vllm_server: healthy at %s after %.0f s", address.base_url, time.monotonic() - start)
            return
        if time.monotonic() - start >= timeout_s:
            raise StageError(
                f"vllm_server: no answer from {address.base_url}{HEALTH_PATH} within {timeout_s:g} s "
                f"(vllm_server.timeout_s), stopped it; last lines of {log_path}: {_tail(log_path)}"
            )
        time.sleep(_POLL_S)


def _healthy(address: ServerAddress) -> bool:
    try:
        url = f"{address.base_url}{HEALTH_PATH}"
        with urllib.request.urlopen(url, timeout=_POLL_S * 2) as response:  # noqa: S310 - http://host:port
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):  # refused, reset, not HTTP yet, 5xx
        return False


def _answers(address: ServerAddress) -> bool:
    """True if something accepts connections at the address already."""
    try:
        with socket.create_connection((address.host, address.port), timeout=1.0):
            return True
    except OSError:
        return False


def _tail(path: Path) -> str:
    """The log's last non-empty lines joined by `` | `` (one line for the error), or a note."""
    try:
        with open(path, "rb") as fh:
            fh.seek(max(0, path.stat().st_size - 16_384))
            text = fh.read().decode("utf-8", "replace")
    except OSError:
        return "(no log)"
    lines = collections.deque((ln.strip() for ln in text.splitlines() if ln.strip()), maxlen=_TAIL_LINES)
    return " | ".join(lines) or "(empty)"
