"""Seconds per GRPO step on a CPU: posttrain's defaults against TRL's defaults made to run on a CPU.

Both variants train the same LoRA (r16) on the same prompts with the same rewards and shapes
(8 generations of up to 128 tokens, batch 8); only the speed-relevant settings differ:

* TRL: ``GRPOTrainer`` with its own defaults plus the two flags a CPU needs (``use_cpu=True``,
  ``bf16=False``, i.e. fp32), so ``gradient_checkpointing=True`` and generation from the fp32 model;
* posttrain: ``posttrain.training.grpo.make_grpo_trainer`` with ``TRAINER_DEFAULTS`` and
  ``model.precision: auto`` (bf16 autocast on an AMX CPU, no gradient checkpointing, no dropout,
  rollouts from a bf16 shadow copy of the policy, LM head projected on completion positions only).

``--variants`` adds ablations: posttrain's defaults with one of those put back (see ``ABLATIONS``).

The first step of each run is a warm-up and is not timed. ``OMP_WAIT_POLICY`` defaults to PASSIVE for
both variants: on a CPU shared with other processes, OpenMP threads that spin-wait make every small op
cost milliseconds (measured 6 ms instead of 0.05 ms per bf16 matmul of a decode step). Usage::

    python benchmarks/grpo_step.py                       # SmolLM2-135M-Instruct, 3 timed steps each
    python benchmarks/grpo_step.py --model tiny-random --steps 2 --max-completion-length 16
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads OpenMP

import torch  # noqa: E402
from transformers import TrainerCallback  # noqa: E402


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step, and how much of it went to generation."""

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.generation: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()
        self.generation.append(0.0)

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(time.perf_counter() - self._start)


def time_generation(trainer, timer: StepTimer) -> None:
    original = trainer._generate_single_turn

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if timer.generation:
                timer.generation[-1] += time.perf_counter() - start

    trainer._generate_single_turn = timed


def build_data(model_path: str, num_examples: int):
    from transformers import AutoTokenizer

    from posttrain.core.config import DataConfig, SyntheticConfig
    from posttrain.data.prepare import prepare_data

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    cfg = DataConfig(
        source="synthetic", synthetic=SyntheticConfig(num_examples=num_examples + 20, seed=1), eval_size=10
    )
    return prepare_data(cfg, tokenizer).train


def run_trl(
    model_path: str, data, shapes: dict, steps: int, seed: int, workdir: str
) -> tuple[StepTimer, list]:
    from trl import GRPOConfig, GRPOTrainer

    from posttrain.core.config import LoraConfig
    from posttrain.models.loading import build_peft_config, load_model_and_tokenizer
    from posttrain.rewards.registry import build_reward
    from posttrain.training.trl_compat import compact_fused_head_on_cpu

    compact_fused_head_on_cpu(False)  # TRL as shipped
    model, tokenizer = load_model_and_tokenizer(model_path, "fp32", for_training=True)
    args = GRPOConfig(
        output_dir=workdir,
        use_cpu=True,
        bf16=False,
        max_steps=steps + 1,
        logging_steps=1,
        seed=seed,
        report_to="none",
        save_strategy="no",
        **shapes,
    )
    rewards = [build_reward("xml_count"), build_reward("correctness")]
    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=rewards,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=build_peft_config(LoraConfig(r=16, alpha=32)),
        callbacks=[timer],
    )
    time_generation(trainer, timer)
    trainer.train()
    return timer, [row["reward"] for row in trainer.state.log_history if "reward" in row]


# Ablations: posttrain's defaults with one setting put back to TRL's (or to fp32).
ABLATIONS = {
    "posttrain": ({}, {}),
    "no-shadow": ({}, {"fast_generation": False}),
    "grad-ckpt": ({"gradient_checkpointing": True}, {}),
    "dropout": ({"disable_dropout": False}, {}),
    "fp32": ({}, {"precision": "fp32"}),
    "full-head": ({}, {"compact_head": False}),
}


def run_posttrain(
    model_path: str, data, shapes: dict, steps: int, seed: int, workdir: str, variant: str = "posttrain"
):
    from posttrain.core.config import GRPOStageConfig, ModelConfig
    from posttrain.models.hardware import resolve_precision
    from posttrain.training.grpo import make_grpo_trainer
    from posttrain.training.runner import StageContext
    from posttrain.training.trl_compat import compact_fused_head_on_cpu

    trainer_overrides, other = ABLATIONS[variant]
    stage = GRPOStageConfig(
        name="bench",
        rewards=[{"name": "xml_count"}, {"name": "correctness"}],
        trainer={"max_steps": steps + 1, **shapes, **trainer_overrides},
    )
    model_cfg = ModelConfig(
        name=model_path, lora={"r": 16, "alpha": 32}, precision=other.get("precision", "auto")
    )
    ctx = StageContext(
        stage="grpo-bench",
        work_dir=Path(workdir),
        seed=seed,
        report_to="none",
        precision=resolve_precision(model_cfg.precision),
    )
    timer = StepTimer()
    trainer, _ = make_grpo_trainer(
        stage,
        model_cfg,
        model_path,
        data,
        ctx,
        callbacks=[timer],
        fast_generation=other.get("fast_generation", True),
    )
    compact_fused_head_on_cpu(other.get("compact_head", True))
    time_generation(trainer, timer)
    trainer.train()
    return timer, [row["reward"] for row in trainer.state.log_history if "reward" in row]


def report(name: str, timer: StepTimer, rewards: list) -> float:
    timed, generation = timer.steps[1:], timer.generation[1:]
    mean = statistics.mean(timed)
    share = sum(generation) / sum(timed)
    trend = " ".join(f"{r:.3f}" for r in rewards)
    print(
        f"{name:10s} {mean:7.2f} s/step (steps: {', '.join(f'{t:.1f}' for t in timed)}; "
        f"generation {share:.0%}; warm-up {timer.steps[0]:.1f} s)  reward per step: {trend}"
    )
    return mean


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="built-in name or model directory")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (after 1 warm-up step)")
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--variants",
        default="trl,posttrain",
        help=f"comma list of trl and {', '.join(ABLATIONS)} (ablations of posttrain's defaults)",
    )
    opts = parser.parse_args()

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    from posttrain.models.hardware import cpu_has_fast_bf16
    from posttrain.models.resolve import resolve_model_path

    model_path = resolve_model_path(opts.model)
    shapes = {
        "num_generations": opts.num_generations,
        "per_device_train_batch_size": opts.num_generations,
        "max_completion_length": opts.max_completion_length,
    }
    data = build_data(model_path, opts.steps + 1)
    print(
        f"model {opts.model}; {opts.steps} timed steps + 1 warm-up; {shapes}; torch threads "
        f"{torch.get_num_threads()}; OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}; CPU fast bf16: "
        f"{cpu_has_fast_bf16()}; load {os.getloadavg()[0]:.2f}"
    )
    results = {}
    for name in opts.variants.split(","):
        with tempfile.TemporaryDirectory() as workdir:
            if name == "trl":
                timer, rewards = run_trl(model_path, data, shapes, opts.steps, opts.seed, workdir)
            else:
                timer, rewards = run_posttrain(model_path, data, shapes, opts.steps, opts.seed, workdir, name)
        results[name] = report(name, timer, rewards)
    if "trl" in results:
        for name, seconds in results.items():
            if name != "trl":
                print(f"{name} / TRL = {seconds / results['trl']:.2f}x")
    print(f"load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
