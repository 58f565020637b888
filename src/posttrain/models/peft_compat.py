"""Every place posttrain reaches into peft's internals: reading a LoRA policy's effective weights.

Pinned to ``PEFT_VERSIONS`` (pyproject's pin); ``tests/integration/test_compat.py`` fails when the installed version
leaves that range or when a hooked name below changes, so lifting the pin means re-checking this file.

:func:`effective_state_dict` reads, on every ``peft.tuners.lora.LoraLayer`` of the model, the
attributes listed in ``LORA_LAYER_CONTRACT`` (``merged``, ``active_adapters``, ``lora_A``,
``get_delta_weight(adapter)``, ``get_base_layer()``) and relies on the state-dict layout of a wrapped
layer (base weights under ``.base_layer.``, adapter weights named ``lora_*``). Why: GRPO's rollouts
come from a bf16 copy of the policy with LoRA merged in, refreshed once per step
(:class:`posttrain.generation.rollout.ShadowPolicy`). peft's public ``merge_and_unload`` changes the
training model in place and ``merge_adapter``/``unmerge_adapter`` round-trip the fp32 master weights
through an addition and a subtraction every step; computing base + delta into the copy touches
neither.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LORA_LAYER_CONTRACT", "PEFT_VERSIONS", "effective_state_dict"]

PEFT_VERSIONS = ">=0.21,<0.22"
"""The peft versions this module was checked against (pyproject's pin)."""

LORA_LAYER_CONTRACT = ("merged", "active_adapters", "lora_A", "get_delta_weight", "get_base_layer")
"""What :func:`effective_state_dict` reads on each LoRA layer (the test checks each still exists)."""


def effective_state_dict(model: Any) -> dict[str, Any]:
    """The policy's weights as a plain model's state dict, LoRA deltas added to their base weights."""
    from peft import PeftModel  # heavy (imports torch and transformers): deferred until needed
    from peft.tuners.lora import LoraLayer

    if not isinstance(model, PeftModel):
        return dict(model.state_dict())
    base = model.get_base_model()
    state: dict[str, Any] = {}
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        state[key.replace(".base_layer.", ".")] = value
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and not module.merged:
            deltas = [module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A]
            if deltas:
                state[f"{name}.weight"] = module.get_base_layer().weight + sum(deltas)
    return state
