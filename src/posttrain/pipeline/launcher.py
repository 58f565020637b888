"""Training stages in their own process tree: ``launch.launcher: accelerate``.

In process, a stage trains inside the Prefect task's process and its memory is only as free
afterwards as Python and the allocator make it. With ``accelerate``, the step instead runs::

    accelerate launch --config_file <launch.accelerate_config> -m posttrain.pipeline.stage_main <request>

accelerate starts ``num_processes`` copies (torchrun for DDP/FSDP, DeepSpeed's launcher for ZeRO);
each rebuilds the plan from the request (the config and the step's inputs: paths and fingerprints)
and runs the same stage function as the in-process path, so rank 0 writes the same output folder,
``stage.json`` and ``.result.json``. This process streams the children's log into its logger and
reads the result back from the output folder once they exit; a child that fails is a
:class:`StageError` naming the stage and the exit code. Resume is unchanged (the checkpoints live
in ``<output>.ckpt`` either way) and so is MLflow: the children report to no tracker, and the
parent logs the stage's history from its output (rank 0's, one stage run).

On a CPU, accelerate starts several processes only through ``mpirun``; ``configs/accelerate/cpu.yaml``
therefore uses the torchrun launcher (``distributed_type: MULTI_GPU``) with ``use_cpu: true``, and
inside the processes accelerate picks MULTI_CPU with the gloo backend. accelerate (1.x) turns FSDP
and DeepSpeed on only for GPU-type runs: a file with ``distributed_type: FSDP`` (or ``DEEPSPEED``)
and ``use_cpu: true`` would train as plain DDP without a word, so :func:`accelerate_setup` refuses
it. Whatever the file, a sharded policy (FSDP, ZeRO-3) is gathered by every rank before rank 0
saves it (:mod:`posttrain.training.sharded`).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from posttrain.cache.records import RecordError, read_output_result
from posttrain.core.config import LaunchConfig, PipelineConfig
from posttrain.core.errors import ConfigError, HardwareError, StageError
from posttrain.core.inputs import load_yaml_bounded, path_problem
from posttrain.core.processes import stop_process_group
from posttrain.core.results import StageResult
from posttrain.models.hardware import cuda_available

logger = logging.getLogger(__name__)

__all__ = [
    "CPU_ACCELERATE_CONFIG",
    "GPU_ACCELERATE_CONFIG",
    "STAGE_MODULE",
    "AccelerateSetup",
    "accelerate_setup",
    "launch_command",
    "launch_stage",
    "world_size",
]

GPU_ACCELERATE_CONFIG = "configs/accelerate/ddp.yaml"
CPU_ACCELERATE_CONFIG = "configs/accelerate/cpu.yaml"
STAGE_MODULE = "posttrain.pipeline.stage_main"
_CPU_TYPES = ("NO", "MULTI_CPU")
_GPU_ONLY_TYPES = ("FSDP", "DEEPSPEED")
"""Sharding that accelerate 1.x enables only without ``cpu`` (accelerate/state.py); with ``use_cpu``
the processes silently run as MULTI_CPU, plain DDP."""
_TAIL_LINES = 20


@dataclass(frozen=True)
class AccelerateSetup:
    """An accelerate config file as this machine will launch it."""

    config_file: str
    num_processes: int
    """The world size: ``launch.num_processes`` if set, else the file's ``num_processes``."""
    needs_cuda: bool
    """The file asks for GPUs (DDP/FSDP/DeepSpeed without ``use_cpu: true``)."""
    port_set: bool
    """The file names its own ``main_process_port``."""
    shards: str | None = None
    """How the file shards the policy across processes (``FSDP``, ``DeepSpeed ZeRO-3``), or None
    where every process holds it whole (DDP, ZeRO-2, one process)."""


def accelerate_setup(launch: LaunchConfig, key: str = "launch.accelerate_config") -> AccelerateSetup:
    """Read the accelerate config file ``launch`` names (the machine's default when it names none).

    Only what posttrain needs from it; accelerate itself validates the whole file when it launches
    (and the tests load every shipped one with accelerate's own loader).
    """
    name = launch.accelerate_config or (GPU_ACCELERATE_CONFIG if cuda_available() else CPU_ACCELERATE_CONFIG)
    path = Path(name).expanduser()
    if path.exists() and (problem := path_problem(path, "file")):
        raise ConfigError(f"{key}: {name} {problem}")  # a FIFO would block the read forever
    try:
        raw = load_yaml_bounded(path.read_text(encoding="utf-8"), name)
    except OSError:
        raise ConfigError(f"{key}: no such accelerate config: {name} (from {Path.cwd()})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{key}: {name} is not UTF-8 text") from None
    except ConfigError as exc:
        raise ConfigError(f"{key}: {str(exc).replace(': invalid YAML', ' is not valid YAML', 1)}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{key}: {name} is not an accelerate config (a YAML mapping)")
    processes = launch.num_processes or raw.get("num_processes", 1)
    if not isinstance(processes, int) or processes < 1:
        raise ConfigError(f"{key}: {name}: num_processes must be a positive integer, not {processes!r}")
    kind = str(raw.get("distributed_type", "NO")).upper()
    if kind in _GPU_ONLY_TYPES and raw.get("use_cpu", False):
        raise ConfigError(
            f"{key}: {name}: distributed_type {kind} with use_cpu: true would train as plain DDP "
            f"(accelerate turns {kind} on only on GPUs); use {CPU_ACCELERATE_CONFIG} on a CPU"
        )
    zero_stage = _zero_stage(raw.get("deepspeed_config"))
    shards = (
        "FSDP" if kind == "FSDP" else "DeepSpeed ZeRO-3" if kind == "DEEPSPEED" and zero_stage == 3 else None
    )
    return AccelerateSetup(
        config_file=str(path),
        num_processes=processes,
        needs_cuda=kind not in _CPU_TYPES and not raw.get("use_cpu", False),
        port_set=raw.get("main_process_port") is not None,
        shards=shards if processes > 1 else None,
    )


_DEEPSPEED_JSON_LIMIT = 1 << 20
"""A DeepSpeed JSON config larger than this is not one (read only for its ZeRO stage)."""


def _zero_stage(section: Any) -> int | None:
    """The ZeRO stage an accelerate file's ``deepspeed_config`` asks for: its ``zero_stage``, or the
    ``zero_optimization.stage`` of the JSON file it names (``deepspeed_config_file``, read from the
    working directory); None where neither says (the trainer checks again once DeepSpeed runs)."""
    if not isinstance(section, dict):
        return None
    if section.get("zero_stage") is not None:
        return section.get("zero_stage")
    name = section.get("deepspeed_config_file")
    if not isinstance(name, str):
        return None
    path = Path(name).expanduser()
    try:
        if path_problem(path, "file") or path.stat().st_size > _DEEPSPEED_JSON_LIMIT:
            return None
        zero = json.loads(path.read_text(encoding="utf-8")).get("zero_optimization", {})
        return zero.get("stage") if isinstance(zero, dict) else None
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return None


def world_size(cfg: PipelineConfig, section: Any) -> int:
    """How many processes train the stage of ``section``: 1 in process."""
    launch = cfg.launch_of(section)
    if launch.launcher != "accelerate":
        return 1
    return accelerate_setup(launch).num_processes


def launch_command(setup: AccelerateSetup, request: str | Path) -> list[str]:
    """The ``accelerate launch`` command line of one stage (this interpreter's accelerate)."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", setup.config_file]
    cmd += ["--num_processes", str(setup.num_processes)]
    if not setup.port_set:  # a free port, so two launches on one machine do not collide
        cmd += ["--main_process_port", "0"]
    return [*cmd, "-m", STAGE_MODULE, str(request)]


def _request(cfg: PipelineConfig, step: str, inputs: Any, output_dir: str) -> dict[str, Any]:
    """What a child needs to run the step: the real config (secrets included, the file is private to
    this user and deleted after the launch) and the step's inputs.

    Only the keys the config set are sent: the child fills in the same defaults, and an unset key
    stays unset (a stage without ``lora:`` follows ``model.lora``; an explicit null would not).
    """
    return {
        "config": cfg.model_dump(mode="python", exclude_unset=True),
        "step": step,
        "model": asdict(inputs.model),
        "data": asdict(inputs.data) if inputs.data is not None else None,
        "scores": asdict(inputs.scores) if inputs.scores is not None else None,
        "output_dir": str(output_dir),
    }


def launch_stage(
    cfg: PipelineConfig, step: str, kind: str, section: Any, inputs: Any, output_dir: str
) -> StageResult:
    """Train plan step ``step`` (of ``kind``) under ``accelerate launch``; the result it wrote."""
    setup = accelerate_setup(cfg.launch_of(section))
    if setup.needs_cuda and not cuda_available():
        raise HardwareError(
            f"{step}: accelerate config {setup.config_file} needs CUDA GPUs and this machine has none; "
            f"use {CPU_ACCELERATE_CONFIG} (launch.accelerate_config) or leave it unset"
        )
    with tempfile.TemporaryDirectory(prefix="posttrain-launch-") as tmp:
        request = Path(tmp, "request.json")
        fd = os.open(request, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(_request(cfg, step, inputs, output_dir), fh, default=str)
        cmd = launch_command(setup, request)
        logger.info("[%s] %d process(es): %s", step, setup.num_processes, " ".join(cmd))
        code, tail = _run_streaming(cmd, step)
    if code != 0:
        last = "\n".join(tail)
        raise StageError(f"stage {step}: accelerate launch exited with code {code}; its last lines:\n{last}")
    try:
        result = read_output_result(kind, Path(output_dir))
    except RecordError as exc:
        raise StageError(
            f"stage {step}: the launched processes exited cleanly but left no result: {exc}"
        ) from None
    assert isinstance(result, StageResult)
    return result


def _run_streaming(cmd: list[str], step: str) -> tuple[int, list[str]]:
    """Run ``cmd`` in its own process group, its output line by line into our log; (exit code, last
    lines). Whatever interrupts us (an error, Ctrl-C, a cancelled task) takes the group down too."""
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(  # noqa: S603 - our own interpreter and module, no shell
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env=env,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            tail.append(line)
            logger.info("[%s] %s", step, line)
        return proc.wait(), list(tail)
    finally:
        if proc.poll() is None:
            stop_process_group(proc)
