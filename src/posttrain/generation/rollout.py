"""GRPO rollouts from a copy of the policy, through the same engine evaluation and DPO sampling use.

Generation is about two thirds of a GRPO step on a CPU. TRL generates with the training model,
whose weights stay fp32 (master weights); with ``bf16=True`` accelerate wraps its forward in
autocast, which re-casts every weight matrix to bf16 on *every decoded token*. For a 135M model
that is ~0.5 GB of memory traffic per token, and it eats most of what the CPU's bf16 matmul units
(AMX) gain. Instead, :class:`ShadowPolicy` keeps a bf16 copy of the policy with LoRA merged in,
refreshes it once per optimizer step (one cast per step, not per token), and :class:`ShadowRollout`
samples from it with :func:`posttrain.generation.engine.generate_continuous`: finished rows leave
the batch, and a draw costs one uniform per row (inverse CDF) instead of ``generate``'s
``torch.multinomial`` and per-token bookkeeping.

Samples are therefore drawn from the bf16-rounded policy while the loss uses the autocast fp32
policy; the difference is the same rounding autocast already applies to every matmul, and GRPO's
old log-probabilities are recomputed from the training model, so the objective is unchanged.

How it plugs into TRL: :class:`ShadowRollout` is a ``rollout_func``, TRL 1.16's public (experimental)
``GRPOTrainer`` argument, called as ``rollout_func(prompts, trainer)`` with the process's prompts (each
already repeated ``num_generations`` times by TRL's sampler) and returning ``prompt_ids``,
``completion_ids`` (one list per prompt) and ``logprobs`` (None: TRL then recomputes what it needs, as
for its own ``generate`` path). Everything after it is TRL's own code in both cases: decoding,
completion masks (ones over each returned completion, right-padded), the truncation flags (a
completion whose last token is not EOS), rewards and metrics. The engine stops each row at its first
stop id and keeps it, which is exactly TRL's "cut after the first EOS". This replaced an override of
TRL's private ``GRPOTrainer._generate_single_turn``: the rollout does the same work either way (the
prompts' chat template is rendered here instead of in TRL), so the public hook costs nothing.

It only covers what it reproduces: temperature-only sampling (TRL's GRPO default) on text prompts.
Any other setting (top-p, top-k, min-p, repetition penalty, ``generation_kwargs``, vLLM, TRL's
continuous batching, TRL's own tools, images) leaves ``rollout_func`` unset, so TRL generates as it
ships (:func:`shadow_rollout_blockers` says why).

A stage with engine ``tools`` (the inline calculator) always rolls out here, on a CPU or a GPU: the
engine forces the tool's tokens and returns them marked in ``env_mask`` (1 = model token, 0 = tool
token), which TRL 1.16 turns into its tool mask: tool tokens leave the loss and the completion-length
counts, while the rewards read the whole text.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from posttrain.core.trainer_options import generation_blockers
from posttrain.generation.engine import (
    EngineTool,
    encode_prompts,
    generate_continuous,
    pad_token_id,
    stop_token_ids,
)
from posttrain.generation.tools import engine_tool
from posttrain.generation.transformers_compat import no_init_weights
from posttrain.models.peft_compat import effective_state_dict

logger = logging.getLogger(__name__)

__all__ = ["ShadowPolicy", "ShadowRollout", "shadow_rollout_blockers"]

ROLLOUT_KEYS = ("prompt_ids", "completion_ids", "logprobs")
"""What TRL 1.16 requires a ``rollout_func`` to return (``GRPOTrainer._generate`` checks them)."""


class ShadowPolicy:
    """A frozen copy of the policy in ``dtype`` that generation can use without autocast."""

    def __init__(self, model: Any, dtype: torch.dtype = torch.bfloat16) -> None:
        from peft import PeftModel  # heavy: deferred until a shadow is built
        from transformers import AutoModelForCausalLM

        base = model.get_base_model() if isinstance(model, PeftModel) else model
        # every weight is overwritten by sync(); random init would cost ~1 s
        with no_init_weights():
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


def shadow_rollout_blockers(args: Any, columns: Iterable[str] = (), tools: Sequence[Any] = ()) -> list[str]:
    """Why TRL must generate itself under these GRPO ``args``; empty when :class:`ShadowRollout` matches it.

    ``columns`` are the training data's columns (images need TRL's multimodal path); ``tools`` are
    TRL's own tool functions (its tool-calling loop runs only when TRL generates).

    >>> from types import SimpleNamespace
    >>> plain = dict(temperature=1.0, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0)
    >>> shadow_rollout_blockers(SimpleNamespace(**plain))
    []
    >>> shadow_rollout_blockers(SimpleNamespace(**{**plain, "top_p": 0.9}), columns=["prompt", "image"])
    ['top_p=0.9', 'image inputs']
    """
    blockers = generation_blockers(args)
    if tools:
        blockers.append("tools")
    if {"image", "images"} & set(columns):
        blockers.append("image inputs")
    return blockers


class ShadowRollout:
    """TRL's ``rollout_func``: one completion per prompt, sampled from a :class:`ShadowPolicy` by the engine.

    The shadow is built on the first call and re-synced from the policy whenever the trainer's
    ``global_step`` has moved, i.e. once per optimizer step however many generation rounds it has.
    Per-row seeds are drawn from torch's global generator, which TRL seeds from ``args.seed``, so a
    run is reproducible and no two rows share a random stream.
    """

    def __init__(
        self,
        dtype: torch.dtype = torch.bfloat16,
        tools: Sequence[str] = (),
        log_metrics: Callable[[Any, dict[str, float]], None] | None = None,
    ) -> None:
        self.dtype = dtype
        self.tools = tuple(tools)
        self.log_metrics = log_metrics
        """Called as ``log_metrics(trainer, metrics)`` with the tool metrics of each rollout."""
        self.shadow: ShadowPolicy | None = None
        self.synced_step: int | None = None
        self._tool: EngineTool | None = None

    def tool(self, tokenizer: Any) -> EngineTool | None:
        """The engine tool of the stage's ``tools:`` (built once, for the trainer's tokenizer)."""
        if self.tools and self._tool is None:
            self._tool = engine_tool(self.tools, tokenizer)
        return self._tool

    def refresh(self, policy: Any, step: int) -> ShadowPolicy:
        """The shadow, (re)built or re-synced from ``policy`` if ``step`` differs from the last sync."""
        if self.shadow is None:
            self.shadow = ShadowPolicy(policy, self.dtype)
        if self.synced_step != step:
            self.shadow.sync(policy)
            self.synced_step = step
        return self.shadow

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        args, tokenizer = trainer.args, trainer.processing_class
        policy = trainer.accelerator.unwrap_model(trainer.model)
        shadow = self.refresh(policy, trainer.state.global_step)
        if isinstance(prompts[0], str):  # already templated text: tokenized as TRL does
            prompt_ids = [list(ids) for ids in tokenizer(text=prompts)["input_ids"]]
        else:
            prompt_ids = encode_prompts(tokenizer, prompts, **(args.chat_template_kwargs or {}))
        seeds = torch.randint(0, 2**62, (len(prompt_ids),)).tolist()
        completions, stats = generate_continuous(
            shadow.model,
            prompt_ids,
            max_new_tokens=args.max_completion_length,
            stop_ids=stop_token_ids(policy, tokenizer),
            pad_token_id=pad_token_id(tokenizer),
            batch_size=len(prompt_ids),
            temperature=args.temperature,
            seeds=seeds,
            tool=self.tool(tokenizer),
        )
        logger.debug("shadow rollout: %s", stats.as_dict())
        output: dict[str, Any] = {
            "prompt_ids": prompt_ids,
            "completion_ids": [list(c.token_ids) for c in completions],
            "logprobs": None,
        }
        if self.tools:  # tool tokens: out of the loss and the token counts (TRL's env_mask contract)
            output["env_mask"] = [list(c.env_mask or ()) for c in completions]
            if self.log_metrics is not None:
                self.log_metrics(trainer, stats.tool_metrics())
        return output
