"""The trained policy, whole, when several processes trained it sharded (FSDP, DeepSpeed ZeRO-3).

Under FSDP2 every rank holds a slice of each parameter (a ``DTensor``); under ZeRO-3 a rank's
parameters are empty placeholders and the engine keeps the slices. The trained model exists whole
on no rank, and putting it together is a collective: every rank has to take part, and a rank 0
that tries alone (``save_pretrained`` on its shards) waits forever for the others. So each stage
calls :func:`policy_to_save` on every rank right after training
(:meth:`posttrain.training.stage_run.TrainOutcome.from_trainer`); rank 0 gets a plain model rebuilt
from the gathered weights, which :func:`posttrain.models.artifacts.save_policy` writes exactly as
in process (merged, adapter or full model, same files, same ``stage.json``).

The gather is the one transformers' ``Trainer.save_model`` uses:

- ZeRO-3 and FSDP1: ``Accelerator.get_state_dict`` (on the DeepSpeed engine, which needs
  ``zero3_save_16bit_model: true`` as configs/accelerate/zero3.yaml sets: the weights come back in
  16 bit; on the FSDP1 wrapper with a rank-0 full state dict);
- FSDP2, recognised on the model itself (torch's ``FSDPModule``): torch's
  ``get_model_state_dict`` with the full-state-dict, CPU-offload options accelerate passes for
  FSDP2. Recognising the model rather than asking accelerate lets the same code run under
  ``fully_shard`` on a CPU, where accelerate 1.x never turns FSDP on (see
  :mod:`posttrain.pipeline.launcher` and tests/system/test_launcher_multiprocess.py).

Rank 0 then holds the weights twice for a moment (the gathered dict and the rebuilt model), on
the CPU; the other ranks return None. With LoRA under ZeRO-3 the frozen base is gathered too
(``Trainer.save_model`` skips it for an adapter), since a merged policy needs it.

Checked on a CPU: FSDP2 (tests/system/test_launcher_multiprocess.py). Not run anywhere yet: ZeRO-3 and
FSDP1, which need GPUs (and the deepspeed package for ZeRO-3).
"""

from __future__ import annotations

import copy
import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["gather_full_state_dict", "planned_sharding", "policy_to_save", "sharding"]


def _is_fsdp2(model: Any) -> bool:
    from torch.distributed.fsdp import FSDPModule  # heavy: deferred until needed

    return isinstance(model, FSDPModule)


def sharding(model: Any, accelerator: Any) -> str | None:
    """How ``model`` is sharded across the processes: ``fsdp2``, ``fsdp1``, ``zero3`` or None
    (every rank holds it whole: in process, DDP, ZeRO-2)."""
    if _is_fsdp2(model):
        return "fsdp2"
    planned = planned_sharding(accelerator)
    return "fsdp1" if planned == "fsdp" else planned


def planned_sharding(accelerator: Any) -> str | None:
    """How ``accelerator`` will shard the policy once the trainer prepares it: ``fsdp``, ``zero3``
    or None (whole on every rank), from accelerate's state, so readable before training starts
    (accelerate sets ``deepspeed_config`` on the accelerator only as it prepares the engine; the
    plugin's ``zero_stage`` holds the stage of a DeepSpeed JSON file too)."""
    kind = str(getattr(accelerator, "distributed_type", "NO")).split(".")[-1]
    if kind == "FSDP":
        return "fsdp"
    if kind == "DEEPSPEED":
        plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
        return "zero3" if getattr(plugin, "zero_stage", None) == 3 else None
    return None


def gather_full_state_dict(model: Any, accelerator: Any, wrapped: Any = None) -> dict[str, Any] | None:
    """The full state dict of a sharded ``model``, gathered by every rank (each must call this):
    on the main process a dict of whole CPU tensors, on the others whatever the gather leaves them
    (empty for FSDP2). None when ``model`` is not sharded. ``wrapped`` is the trainer's
    ``model_wrapped`` (the DeepSpeed engine under ZeRO-3)."""
    kind = sharding(model, accelerator)
    if kind is None:
        return None
    if kind == "fsdp2":
        from torch.distributed.checkpoint.state_dict import (  # heavy: deferred until needed
            StateDictOptions,
            get_model_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=options)
    return accelerator.get_state_dict(wrapped if kind == "zero3" and wrapped is not None else model)


def policy_to_save(model: Any, accelerator: Any, wrapped: Any = None) -> Any:
    """What :func:`~posttrain.models.artifacts.save_policy` should write; every rank must call it.

    ``model`` itself when every rank holds it whole; when it is sharded, a plain copy rebuilt from
    the gathered weights on the main process and None on the others.
    """
    kind = sharding(model, accelerator)
    if kind is None:
        return model
    logger.info("gathering the %s-sharded policy on every rank for saving", kind)
    state = gather_full_state_dict(model, accelerator, wrapped)
    if not accelerator.is_main_process:
        return None
    assert state, f"the {kind} gather left the main process no weights"
    # The template's classes and configs: the FSDP1 wrapper's inner module (a no-op for FSDP2,
    # whose model is its own module, and for ZeRO-3, whose trainer.model is the plain module).
    return _rebuild(accelerator.unwrap_model(model), state)


def _plain_class(module: Any) -> type:
    """``module``'s own class: ``fully_shard`` swaps a module's class for a subclass of it and
    ``FSDPModule`` (documented), which a fresh copy must not be."""
    from torch.distributed.fsdp import FSDPModule  # heavy: deferred until needed

    return next(c for c in type(module).__mro__ if not issubclass(c, FSDPModule))


def _rebuild(model: Any, state: dict[str, Any]) -> Any:
    """A plain, unsharded copy of ``model`` (a transformers model, or a PeftModel around one)
    holding ``state``. Built with the class's constructor, not ``from_config``: under ZeRO-3,
    ``from_config`` would partition the copy again (``deepspeed.zero.Init``), a collective."""
    from peft import PeftModel, get_peft_model  # heavy: deferred until needed

    peft = isinstance(model, PeftModel)
    base = model.get_base_model() if peft else model
    host = _plain_class(base)(copy.deepcopy(base.config))
    host.generation_config = copy.deepcopy(base.generation_config)
    host.name_or_path = base.name_or_path  # what an adapter's config records as its base
    if peft:
        adapter = model.active_adapter
        host = get_peft_model(host, copy.deepcopy(model.peft_config[adapter]), adapter_name=adapter)
    dtype = next((v.dtype for v in state.values() if v.is_floating_point()), None)
    if dtype is not None:
        host.to(dtype)
    host.load_state_dict(state, strict=True)
    return host
