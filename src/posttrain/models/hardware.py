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

__all__ = [
    "check_hardware",
    "cpu_has_fast_bf16",
    "cpu_kind",
    "cuda_available",
    "decode_flops_per_token",
    "matmul_gflops",
    "resolve_dtype",
    "resolve_precision",
]


@cache
def cpu_has_fast_bf16() -> bool:
    """True where the CPU has native bf16 matmul (AMX or AVX512-BF16): there bf16 beats fp32 ~4x."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cpu_kind() -> str:
    """``"<model name> (AMX | avx512_bf16, no AMX | no native bf16)"``: timings move by up to 2x between
    the CPUs a run meets, so benchmarks print which kind they ran on."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown CPU"
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    if "amx_bf16" in flags:
        return f"{model} (AMX)"
    return f"{model} ({'avx512_bf16, no AMX' if 'avx512_bf16' in flags else 'no native bf16'})"


def matmul_gflops(dtype, seconds: float = 1.5, shapes=None) -> float:
    """Best ``torch.matmul`` GFLOP/s in ``dtype`` over ``shapes`` (m, k, n); by default the shapes a
    small model's training multiplies (tokens x hidden by hidden x MLP width, both ways) and a
    square one: the rate against which a benchmark reads what a variant achieves."""
    import time

    import torch  # heavy: deferred until needed

    best = 0.0
    for m, k, n in shapes or [(2048, 576, 1536), (2048, 1536, 576), (1024, 1024, 1024)]:
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        torch.matmul(a, b)
        count, start = 0, time.perf_counter()
        while count < 3 or time.perf_counter() - start < seconds / 3:
            torch.matmul(a, b)
            count += 1
        best = max(best, 2 * m * k * n * count / (time.perf_counter() - start) / 1e9)
    return best


def decode_flops_per_token(config, context: float) -> float:
    """FLOPs of one decoded token of a decoder-only transformer: 2 x (every layer's weights and the LM
    head) plus attention over ``context`` cached positions (scores and weighted values).

    >>> from types import SimpleNamespace
    >>> c = SimpleNamespace(hidden_size=4, num_hidden_layers=1, num_attention_heads=2,
    ...                     num_key_value_heads=1, intermediate_size=8, vocab_size=10)
    >>> decode_flops_per_token(c, context=3)
    416.0
    """
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * config.intermediate_size
    weights = config.num_hidden_layers * (attention + mlp) + config.vocab_size * hidden
    return float(2 * weights + config.num_hidden_layers * 4 * heads * head_dim * context)


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
