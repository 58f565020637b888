"""Precision and hardware: which dtype `model.precision: auto` means here, and clear failures for
GPU-only options (fp16, 4-bit, 8-bit optimizers, vLLM) on a machine without CUDA.

Checked when a stage or an evaluation starts, not when a config validates, so a GPU config still
validates on a laptop.
"""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path

from posttrain.core.errors import HardwareError

__all__ = ["check_hardware", "cpu_has_fast_bf16", "cuda_available", "resolve_dtype", "resolve_precision"]


@cache
def cpu_has_fast_bf16() -> bool:
    """True where the CPU has native bf16 matmul (AMX or AVX512-BF16): there bf16 beats fp32 ~4x."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cuda_available() -> bool:
    import torch  # heavy: deferred until needed

    return torch.cuda.is_available()


def resolve_precision(precision: str) -> str:
    """Map `auto` to the fastest safe precision on this machine: 'bf16', 'fp16' or 'fp32'."""
    import torch  # heavy: deferred until needed

    if precision != "auto":
        return precision
    if cuda_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_has_fast_bf16() else "fp32"


def resolve_dtype(precision: str):
    import torch  # heavy: deferred until needed

    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        resolve_precision(precision)
    ]


def check_hardware(
    precision: str = "auto", quantization: str = "none", optim: str | None = None, use_vllm: bool = False
) -> None:
    """Fail with a clear message when a config asks for hardware this machine lacks."""
    gpu = cuda_available()
    if precision == "fp16" and not gpu:
        raise HardwareError("model.precision: fp16 needs a CUDA GPU; use auto, bf16 or fp32 on a CPU")
    if quantization == "4bit" and not gpu:
        raise HardwareError(
            "model.quantization: 4bit (bitsandbytes NF4) needs a CUDA GPU; "
            "remove it (and keep LoRA) to train on this CPU"
        )
    if optim and "8bit" in optim and not gpu:
        raise HardwareError(
            f"trainer.optim: {optim} (bitsandbytes) needs a CUDA GPU; use adamw_torch on a CPU"
        )
    if (quantization == "4bit" or (optim and "8bit" in optim)) and not _importable("bitsandbytes"):
        raise HardwareError("bitsandbytes is not installed: pip install 'posttrain[gpu]'")
    if use_vllm and not gpu:
        raise HardwareError("vLLM needs a CUDA GPU; set use_vllm: false (or eval.backend: hf) on a CPU")
    if use_vllm and not _importable("vllm"):
        raise HardwareError("vLLM is not installed: pip install 'posttrain[gpu]'")


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None
