"""GRPO rollouts from a bf16 copy of the policy: the CPU speed-up that matters most.

Generation is about two thirds of a GRPO step on a CPU. TRL generates with the training model,
whose weights stay fp32 (master weights); with ``bf16=True`` accelerate wraps its forward in
autocast, which re-casts every weight matrix to bf16 on *every decoded token*. For a 135M model
that is ~0.5 GB of memory traffic per token, and it eats most of what the CPU's bf16 matmul units
(AMX) gain. Instead, :class:`ShadowPolicy` keeps a bf16 copy of the policy with LoRA merged in,
refreshes it once per generation round (one cast per step, not per token) and generates from it.

Samples are therefore drawn from the bf16-rounded policy while the loss uses the autocast fp32
policy; the difference is the same rounding autocast already applies to every matmul, and GRPO's
old log-probabilities are recomputed from the training model, so the objective is unchanged.

With TRL's default sampling settings (temperature only) the rollout is a short KV-cache loop
(:func:`sample_plain`) instead of ``generate``: same distribution, but inverse-CDF draws instead of
``torch.multinomial`` (8 ms per step on a 49k vocabulary here) and none of ``generate``'s per-token
bookkeeping; measured ~25% faster for 8 x 64 tokens of SmolLM2. Other settings use ``generate``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from typing import Any

import torch
from trl import GRPOTrainer

logger = logging.getLogger(__name__)

__all__ = ["FastGRPOTrainer", "ShadowPolicy", "effective_state_dict"]


def effective_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The policy's weights as a plain model's state dict, LoRA deltas added to their base weights."""
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    if not isinstance(model, PeftModel):
        return dict(model.state_dict())
    base = model.get_base_model()
    state: dict[str, torch.Tensor] = {}
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


class ShadowPolicy:
    """A frozen copy of the policy in ``dtype`` that generation can use without autocast."""

    def __init__(self, model: Any, dtype: torch.dtype = torch.bfloat16) -> None:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = model.get_base_model() if isinstance(model, PeftModel) else model
        with _no_init_weights():  # every weight is overwritten by sync(); random init would cost ~1 s
            self.model = AutoModelForCausalLM.from_config(base.config, dtype=dtype).eval()
        self.model.generation_config = base.generation_config
        self.model.requires_grad_(False)
        self.dtype = dtype

    @torch.no_grad()
    def sync(self, policy: Any) -> None:
        state = effective_state_dict(policy)
        missing = [name for name, _ in self.model.named_parameters() if name not in state]
        if missing:
            raise RuntimeError(f"shadow policy: no weights for {missing[:3]} (unsupported adapter layout)")
        for name, param in self.model.named_parameters():
            param.copy_(state[name])
        for name, buffer in self.model.named_buffers():
            if name in state:
                buffer.copy_(state[name])


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # moved in another transformers version: fall back to (slower) random init
        return contextlib.nullcontext()
    return no_init_weights()


class FastGRPOTrainer(GRPOTrainer):
    """GRPOTrainer that samples rollouts from a :class:`ShadowPolicy` on a CPU with bf16 autocast.

    Only the plain transformers generation path is replaced; vLLM, continuous batching, tools and
    multimodal prompts fall through to TRL unchanged.
    """

    def __init__(self, *args: Any, shadow_dtype: torch.dtype = torch.bfloat16, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._shadow: ShadowPolicy | None = None
        self._shadow_dtype = shadow_dtype
        self._shadow_step = -1

    def _use_shadow(self, images: Any, multimodal_fields: Any) -> bool:
        return not (
            self.use_vllm
            or self.use_transformers_continuous_batching
            or images
            or multimodal_fields
            or self.tools
            or self.accelerator.device.type != "cpu"
        )

    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        if not self._use_shadow(images, multimodal_fields):
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images
            )
        if self._shadow is None:
            self._shadow = ShadowPolicy(self.accelerator.unwrap_model(self.model), self._shadow_dtype)
            # As TRL does for its own generation: the model's saved defaults must not fill in sampling
            # settings TRL left at their global defaults (transformers#42762).
            self._shadow.model.generation_config = copy.deepcopy(self.generation_config)
        if self._shadow_step != self.state.global_step:
            self._shadow.sync(self.accelerator.unwrap_model(self.model))
            self._shadow_step = self.state.global_step
        return generate_completion_ids(
            self._shadow.model,
            prompt_ids,
            self.generation_config,
            self._tokenizer.pad_token_id,
            self.eos_token_ids,
        ), None


def _left_pad(prompt_ids: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, ids in enumerate(prompt_ids):
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
    return input_ids, attention_mask


def _cut_after_eos(rows: list[list[int]], eos_token_ids: list[int]) -> list[list[int]]:
    eos = set(eos_token_ids)
    completions = []
    for row in rows:
        cut = next((i for i, token in enumerate(row) if token in eos), None)
        completions.append(row[: cut + 1] if cut is not None else row)
    return completions


def is_plain_sampling(config: Any) -> bool:
    """True when ``config`` asks for nothing but temperature sampling (TRL's defaults)."""
    return (
        bool(getattr(config, "do_sample", False))
        and (getattr(config, "temperature", None) or 0) > 0
        and getattr(config, "top_p", None) in (None, 1.0)
        and getattr(config, "top_k", None) in (None, 0)
        and getattr(config, "min_p", None) is None
        and getattr(config, "repetition_penalty", None) in (None, 1.0)
        and getattr(config, "cache_implementation", None) is None
    )


def draw_tokens(probs: torch.Tensor) -> torch.Tensor:
    """One token per row of ``probs`` by inverse CDF: the first index whose cumulative mass exceeds a uniform."""
    cdf = probs.cumsum(-1)
    uniform = torch.rand(probs.shape[0], 1) * cdf[:, -1:]  # scaled: the float sum is not exactly 1
    return torch.searchsorted(cdf, uniform, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(1)


@torch.no_grad()
def sample_plain(
    model: Any,
    prompt_ids: list[list[int]],
    *,
    max_new_tokens: int,
    temperature: float,
    pad_token_id: int,
    eos_token_ids: list[int],
) -> list[list[int]]:
    """Temperature sampling with a KV cache: ``generate``'s result for plain settings, with less overhead.

    Tokens are drawn by inverse CDF (``searchsorted`` of a uniform in the cumulative probabilities), the
    same distribution as ``generate``'s ``torch.multinomial``, which costs ~8 ms per step on a 49k
    vocabulary on this CPU against ~0.3 ms. Rows stop at their first EOS; the loop stops when all have.
    """
    from transformers import DynamicCache

    input_ids, mask = _left_pad(prompt_ids, pad_token_id)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    eos = torch.tensor(eos_token_ids)
    finished = torch.zeros(len(prompt_ids), dtype=torch.bool)
    generated: list[torch.Tensor] = []
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    for _ in range(max_new_tokens):
        tokens = draw_tokens(torch.softmax(out.logits[:, -1].float() / temperature, dim=-1))
        tokens = tokens.masked_fill(finished, pad_token_id)
        generated.append(tokens)
        finished |= torch.isin(tokens, eos)
        if bool(finished.all()):
            break
        mask = torch.cat([mask, mask.new_ones((len(prompt_ids), 1))], dim=1)
        positions = positions[:, -1:] + 1
        out = model(
            input_ids=tokens[:, None],
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
        )
    return _cut_after_eos(torch.stack(generated, dim=1).tolist(), eos_token_ids)


@torch.no_grad()
def generate_completion_ids(
    model: Any,
    prompt_ids: list[list[int]],
    generation_config: Any,
    pad_token_id: int,
    eos_token_ids: list[int],
) -> list[list[int]]:
    """Completions for left-padded prompts, each cut after its first EOS (kept), as TRL does.

    Plain temperature sampling goes through :func:`sample_plain`; anything else (top-p, top-k,
    penalties, greedy) through ``generate``.
    """
    if is_plain_sampling(generation_config):
        return sample_plain(
            model,
            prompt_ids,
            max_new_tokens=generation_config.max_new_tokens,
            temperature=generation_config.temperature,
            pad_token_id=pad_token_id,
            eos_token_ids=eos_token_ids,
        )
    input_ids, attention_mask = _left_pad(prompt_ids, pad_token_id)
    output = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, generation_config=generation_config
    )
    return _cut_after_eos(output[:, input_ids.shape[1] :].tolist(), eos_token_ids)
