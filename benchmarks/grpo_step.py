"""Seconds per GRPO step on a CPU: posttrain's defaults against TRL's defaults made to run on a CPU.

Both variants train the same LoRA (r16) on the same prompts with the same rewards and shapes
(8 generations of up to 128 tokens, batch 8); only the speed-relevant settings differ:

* TRL: ``GRPOTrainer`` with its own defaults plus the two flags a CPU needs (``use_cpu=True``,
  ``bf16=False``, i.e. fp32), so ``gradient_checkpointing=True`` and generation from the fp32 model;
* posttrain: ``posttrain.training.grpo.make_grpo_trainer`` with ``TRAINER_DEFAULTS`` and
  ``model.precision: auto`` (bf16 autocast on an AMX CPU, no gradient checkpointing, no dropout,
  rollouts from a bf16 shadow copy of the policy, LM head projected on completion positions only).

``--variants`` adds ablations: posttrain's defaults with one of those put back (see ``ABLATIONS``).
On a CPU without fast bf16 (no AMX or AVX512-BF16) ``auto`` means fp32, and posttrain's default then
samples fp32 rollouts from an fp32 shadow copy through posttrain's engine (``fp32-shadow`` is that
variant spelled out; ``no-shadow`` generates with TRL as TRL does); ``bf16`` forces the bf16 path
(autocast + bf16 shadow rollouts).

Each variant reports seconds per step, the share spent generating, and tokens generated per step
with their rate (tokens / generation seconds), since steps that sample longer completions cost more;
the comparison with TRL is given per step and per generated token.

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
    """Wall and CPU time of every optimizer step, how much of it went to generation, and tokens generated.

    CPU time (this process, all threads) is what a variant costs whatever else the machine runs; on a
    shared machine wall times of runs minutes apart are not comparable, CPU times mostly are.
    """

    def __init__(self) -> None:
        self.steps: list[float] = []
        self.cpu: list[float] = []
        self.generation: list[float] = []
        self.generation_cpu: list[float] = []
        self.tokens: list[int] = []
        self._start = self._start_cpu = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start, self._start_cpu = time.perf_counter(), time.process_time()
        self.generation.append(0.0)
        self.generation_cpu.append(0.0)
        self.tokens.append(0)

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(time.perf_counter() - self._start)
        self.cpu.append(time.process_time() - self._start_cpu)


def time_generation(trainer, timer: StepTimer) -> None:
    """Wrap whichever generation entry the trainer uses: its ``rollout_func``, else TRL's own."""
    name = "rollout_func" if getattr(trainer, "rollout_func", None) is not None else "_generate_single_turn"
    original = getattr(trainer, name)

    def timed(*args, **kwargs):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = original(*args, **kwargs)
        if timer.generation:
            timer.generation[-1] += time.perf_counter() - start
            timer.generation_cpu[-1] += time.process_time() - start_cpu
            ids = result["completion_ids"] if isinstance(result, dict) else result[0]
            timer.tokens[-1] += sum(len(row) for row in ids)
        return result

    setattr(trainer, name, timed)


def build_data(model_path: str, num_examples: int):
    from transformers import AutoTokenizer

    from posttrain.core.config import DataConfig, SyntheticConfig
    from posttrain.data.prepare import prepare_data

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    cfg = DataConfig(
        source="synthetic", synthetic=SyntheticConfig(num_examples=num_examples + 20), eval_size=10, seed=1
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
    "bf16": ({}, {"precision": "bf16"}),  # bf16 autocast + bf16 rollouts even where `auto` means fp32
    "fp32-shadow": ({}, {"precision": "fp32", "shadow": "fp32"}),  # fp32, rollouts from an fp32 shadow
    "full-head": ({}, {"compact_head": False}),
}


def run_posttrain(
    model_path: str, data, shapes: dict, steps: int, seed: int, workdir: str, variant: str = "posttrain"
):
    from posttrain.core.config import GRPOStageConfig, ModelConfig
    from posttrain.models.hardware import resolve_precision
    from posttrain.training.grpo import make_grpo_trainer
    from posttrain.training.stage_run import StageContext
    from posttrain.training.trl_compat import compact_fused_head_on_cpu

    trainer_overrides, other = ABLATIONS[variant]
    stage = GRPOStageConfig(
        name="bench",
        rewards=[{"name": "xml_count"}, {"name": "correctness"}],
        # No checkpoints (posttrain writes one every tenth of a stage), like the TRL variant above.
        trainer={"max_steps": steps + 1, "save_strategy": "no", **shapes, **trainer_overrides},
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
    if "shadow" in other and trainer.rollout_func is None:
        from posttrain.generation.rollout import ShadowRollout
        from posttrain.models.hardware import resolve_dtype

        trainer.rollout_func = ShadowRollout(resolve_dtype(other["shadow"]))
    time_generation(trainer, timer)
    trainer.train()
    return timer, [row["reward"] for row in trainer.state.log_history if "reward" in row]


def report(name: str, timer: StepTimer, rewards: list) -> tuple[float, float, float]:
    """Print one variant's line; return its mean wall and CPU seconds and tokens per timed step."""
    timed, cpu, tokens = timer.steps[1:], timer.cpu[1:], timer.tokens[1:]
    generation = max(sum(timer.generation[1:]), 1e-9)
    generation_cpu = max(sum(timer.generation_cpu[1:]), 1e-9)
    mean, mean_cpu = statistics.mean(timed), statistics.mean(cpu)
    trend = " ".join(f"{r:.3f}" for r in rewards)
    print(
        f"{name:10s} {mean:7.2f} s/step, CPU {mean_cpu:.1f} s/step (steps: {', '.join(f'{t:.1f}' for t in timed)}; "
        f"generation {generation / sum(timed):.0%}, {sum(tokens) / len(tokens):.0f} tokens/step at "
        f"{sum(tokens) / generation:.1f} tok/s, {sum(tokens) / generation_cpu:.1f} tok per CPU-s; "
        f"warm-up {timer.steps[0]:.1f} s)  reward per step: {trend}"
    )
    return mean, mean_cpu, sum(tokens) / len(tokens)


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
    from posttrain.models.hardware import cpu_kind
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
        f"{torch.get_num_threads()}; OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}; CPU {cpu_kind()}; "
        f"load {os.getloadavg()[0]:.2f}"
    )
    results = {}
    for name in opts.variants.split(","):
        with tempfile.TemporaryDirectory() as workdir:
            if name == "trl":
                timer, rewards = run_trl(model_path, data, shapes, opts.steps, opts.seed, workdir)
            else:
                timer, rewards = run_posttrain(model_path, data, shapes, opts.steps, opts.seed, workdir, name)
        results[name] = report(name, timer, rewards)
    for line in versus_trl(results):
        print(line)
    print(f"load average now {os.getloadavg()[0]:.2f}")


def versus_trl(results: dict[str, tuple[float, float, float]]) -> list[str]:
    """One line per variant comparing it with TRL (``results``: name → what :func:`report` returns).

    The variants sample different completions, so seconds per generated token is the like-for-like
    ratio; seconds per step are given too.

    >>> versus_trl({"trl": (4.0, 8.0, 100.0), "posttrain": (4.0, 6.0, 200.0)})
    ['posttrain / TRL = 1.00x per step (CPU time 0.75x), 0.50x per generated token (200 vs 100 tokens/step)']
    """
    if "trl" not in results:
        return []
    wall, cpu, tokens = results["trl"]
    return [
        f"{name} / TRL = {seconds / wall:.2f}x per step (CPU time {cpu_seconds / cpu:.2f}x), "
        f"{(seconds / max(n, 1)) / (wall / max(tokens, 1)):.2f}x per generated token "
        f"({n:.0f} vs {tokens:.0f} tokens/step)"
        for name, (seconds, cpu_seconds, n) in results.items()
        if name != "trl"
    ]


if __name__ == "__main__":
    main()
