"""Loading models and tokenizers for generation or training, adapter chains included.

Any stage input or output loads through :func:`load_stage_model` (alias of the adapter-aware
:func:`load_model_and_tokenizer`): a standalone model directly, an adapter directory by loading its
recorded base (recursively), merging, and only then casting to the inference precision.

torch, transformers and peft are imported inside the functions (heavy: seconds), so commands that
never load a model stay fast.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from posttrain.core.errors import ModelError, StageError
from posttrain.core.peft_options import build_lora_config
from posttrain.models.artifacts import STAGE_FILE, adapter_root, is_adapter_dir, read_stage_json
from posttrain.models.hardware import check_hardware, cuda_available, resolve_dtype
from posttrain.models.resolve import resolve_model_path

logger = logging.getLogger(__name__)

__all__ = ["build_peft_config", "load_model_and_tokenizer", "load_stage_model", "load_tokenizer"]


def load_tokenizer(path: str, revision: str | None = None, padding_side: str = "left"):
    from transformers import AutoTokenizer  # heavy: deferred until needed

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
    import torch  # heavy: deferred until needed
    from transformers import AutoModelForCausalLM  # heavy: deferred until needed

    if is_adapter_dir(name_or_path):
        # A stage saved with adapter_policy: adapter: merged onto its recorded base.
        return load_stage_model(
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
        from transformers import BitsAndBytesConfig  # heavy: deferred until needed

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
    """The peft ``LoraConfig`` of posttrain's ``model.lora`` section, every peft option passed through."""
    return build_lora_config(lora_cfg.peft_options())


def load_stage_model(
    name_or_path: str | Path,
    precision: str = "auto",
    cache_dir: str | Path | None = None,
    *,
    for_training: bool = False,
    quantization: str = "none",
    attn_implementation: str | None = None,
    revision: str | None = None,
):
    """Load any stage input or output as ``(model, tokenizer)``, following adapter chains.

    ``revision`` (``model.revision``) applies to a hub id, tokenizer and weights alike; local
    directories (stage outputs) ignore it.

    Standalone models go straight to :func:`load_model_and_tokenizer`. An adapter directory
    loads its base in fp32 (recursively), applies the adapter, merges it and only then casts to the
    inference precision: merging into bf16 weights would round the update away. The tokenizer comes
    from the adapter directory (stages save it next to the adapter).
    """
    import torch  # heavy: deferred until needed
    from peft import PeftModel  # heavy: deferred until needed

    path = str(name_or_path)
    if not is_adapter_dir(path):
        return load_model_and_tokenizer(
            path,
            precision,
            cache_dir,
            for_training=for_training,
            quantization=quantization,
            attn_implementation=attn_implementation,
            revision=revision,
        )
    base = (read_stage_json(path).get("adapter") or {}).get("base")
    if not base:
        raise StageError(f"{path} is an adapter without a recorded base (adapter.base in {STAGE_FILE})")
    model, _ = load_stage_model(
        base,
        "fp32" if not cuda_available() else precision,
        cache_dir,
        for_training=True,
        quantization=quantization,
        attn_implementation=attn_implementation,
        revision=revision,
    )
    model = PeftModel.from_pretrained(model, path).merge_and_unload()
    tokenizer = load_tokenizer(path, padding_side="right" if for_training else "left")
    if not for_training:
        model = model.to(resolve_dtype(precision)).eval()
    elif not cuda_available():
        model = model.to(torch.float32)
    logger.info("loaded %s = %s + adapter(s)", path, adapter_root(path))
    return model, tokenizer
