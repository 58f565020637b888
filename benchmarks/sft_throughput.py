"""Tokens/s of an SFT step: posttrain's SFT stage against TRL's ``SFTTrainer`` defaults.

Every variant fully fine-tunes the same model on the same GSM8K-format prompt/completion rows (the
real train split beside the repository when it is there, else posttrain's synthetic generator) with
the same per-device batch, ``max_length`` and precision (posttrain's ``model.precision``, ``auto`` by
default: bf16 autocast on a CPU with AMX or AVX512-BF16, else fp32; TRL gets the same flag). Only the
speed-relevant settings differ:

* ``trl``: ``SFTTrainer`` with ``SFTConfig``'s defaults plus what a CPU needs (``use_cpu=True`` and the
  precision flag): gradient checkpointing on, and TRL's fused LM head projecting every position onto
  the vocabulary (prompt and padding included) on a device without Triton;
* ``posttrain``: the SFT stage's own trainer (:func:`posttrain.training.sft.make_sft_trainer` with
  ``TRAINER_DEFAULTS["sft"]``): no gradient checkpointing, the LM head projected on completion
  positions only (posttrain.training.trl_compat).

``--variants`` adds ablations: posttrain's settings with one TRL option changed (``ABLATIONS``).

The variants run side by side: each trains in its own thread with its own ``trainer.train()``, and
they take turns (:class:`Turns`): one warm-up step each (not counted), then ``--repeats`` rounds in
which each variant runs ``--steps`` steps while the others wait, so load from other processes falls
on all of them alike. Every variant is reseeded when it first gets its turn, so unpacked variants
train on the same batches in the same order. Tokens are real tokens (prompt and completion, no
padding) of the batches the timed steps trained on. FLOPs are estimated as 6 x parameters x tokens
and compared with the best ``torch.matmul`` rate measured in the same run and dtype (the "matmul
limit"). Usage::

    python benchmarks/sft_throughput.py                        # SmolLM2-135M-Instruct, batch 8, 512 tokens
    python benchmarks/sft_throughput.py --tiny --steps 1 --repeats 1 --batch 2 --max-length 64
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when torch loads OpenMP (see grpo_step.py)

import torch  # noqa: E402
from transformers import PrinterCallback, TrainerCallback  # noqa: E402

from posttrain.models.hardware import cpu_kind, matmul_gflops  # noqa: E402

GSM8K_TRAIN = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "train.jsonl"

# Ablations: posttrain's SFT settings with TRL options changed ({} is posttrain's own).
ABLATIONS: dict[str, dict] = {
    "posttrain": {},
    "grad-ckpt": {"activation_checkpointing": True},  # TRL's default
    "full-head": {"compact_head": False},  # TRL's fused head as shipped: every position projected
    "padding-free": {"padding_free": True, "max_length": None},  # TRL refuses padding_free with max_length
    "packing": {"packing": True},  # bfd packing into rows of max_length (implies padding_free)
    "group-by-length": {"train_sampling_strategy": "group_by_length"},
}


class Turns:
    """Trainers training in threads take turns: only the holder runs, the others wait.

    Every thread first ``arrive``s (so no trainer's setup overlaps another's timed steps), then
    ``wait``s for its turn and ``pass_on``s after each block of steps; a finished (or failed) thread
    passes on for good.
    """

    def __init__(self, names: Sequence[str]) -> None:
        self._names = list(names)
        self._holder: str | None = self._names[0]
        self._finished: set[str] = set()
        self._cond = threading.Condition()
        self._arrived = threading.Barrier(len(self._names))

    def arrive(self) -> None:
        with contextlib.suppress(threading.BrokenBarrierError):  # a variant failed before training: go on
            self._arrived.wait()

    def wait(self, name: str, timeout: float | None = None) -> bool:
        """Block until it is ``name``'s turn (False if ``timeout`` seconds pass first)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._holder == name, timeout)

    def pass_on(self, name: str, *, finished: bool = False) -> None:
        with self._cond:
            if finished:
                self._finished.add(name)
                self._arrived.abort()  # harmless once everyone arrived; frees the others if not
            if self._holder != name:
                return
            start = self._names.index(name)
            ring = self._names[start + 1 :] + self._names[: start + 1]
            self._holder = next((n for n in ring if n not in self._finished), None)
            self._cond.notify_all()


@dataclass
class Measured:
    """What one variant's timed steps did."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    """Real (non-pad) tokens of each timed step's batch."""
    positions: list[int] = field(default_factory=list)
    """Positions each timed step computed (padding included)."""
    warmup: float = 0.0

    def tokens_per_s(self) -> float:
        return sum(self.tokens) / max(sum(self.wall), 1e-9)

    def tokens_per_cpu_s(self) -> float:
        return sum(self.tokens) / max(sum(self.cpu), 1e-9)


class CountingCollator:
    """The trainer's collator, recording each batch's real tokens and computed positions in order.

    The dataloader fetches ahead of the step that uses a batch, so step ``i`` (no gradient
    accumulation) trained on the ``i``-th batch recorded here.
    """

    def __init__(self, collate: Callable) -> None:
        self.collate = collate
        self.tokens: list[int] = []
        self.positions: list[int] = []

    def __call__(self, examples):
        batch = self.collate(examples)
        mask = batch.get("attention_mask")
        positions = batch["input_ids"].numel()
        # Padding-free batches are one flattened row without an attention mask and, unless
        # pad_to_multiple_of is set, without padding.
        self.tokens.append(int(mask.sum()) if mask is not None else positions)
        self.positions.append(positions)
        return batch


class TakeTurns(TrainerCallback):
    """Times one variant's steps while it holds the turn; hands the turn on after each block."""

    def __init__(
        self, name: str, turns: Turns, blocks: Sequence[int], on_turn: Callable[[], None], seed: int
    ) -> None:
        self.name, self.turns, self.blocks, self.on_turn, self.seed = name, turns, list(blocks), on_turn, seed
        self.walls: list[float] = []
        self.cpus: list[float] = []
        self._block = self._in_block = 0
        self._start = self._start_cpu = 0.0

    def _take_turn(self) -> None:
        self.turns.wait(self.name)
        self.on_turn()

    def on_train_begin(self, args, state, control, **kwargs):
        self.turns.arrive()
        self._take_turn()
        # The sampler draws its order from torch's global generator right after this, while this
        # thread holds the turn: the same seed gives every variant the same batches.
        torch.manual_seed(self.seed)

    def on_step_begin(self, args, state, control, **kwargs):
        self._start, self._start_cpu = time.perf_counter(), time.process_time()

    def on_step_end(self, args, state, control, **kwargs):
        # process_time counts every thread, but the other variants are blocked while this one runs.
        self.walls.append(time.perf_counter() - self._start)
        self.cpus.append(time.process_time() - self._start_cpu)
        self._in_block += 1
        if self._block < len(self.blocks) and self._in_block == self.blocks[self._block]:
            self._block, self._in_block = self._block + 1, 0
            self.turns.pass_on(self.name)
            self._take_turn()

    def on_train_end(self, args, state, control, **kwargs):
        self.turns.pass_on(self.name, finished=True)


def build_rows(model_path: str, data: str, num_examples: int, seed: int):
    """Prepared training records (GSM8K format, with ``prompt`` and ``solution``)."""
    from posttrain.core.config import DataConfig, SyntheticConfig
    from posttrain.data.prepare import prepare_data
    from posttrain.models.loading import load_tokenizer

    if data == "synthetic":
        cfg = DataConfig(
            source="synthetic",
            synthetic=SyntheticConfig(num_examples=num_examples + 10),
            eval_size=10,
            seed=seed,
        )
    else:
        cfg = DataConfig(source="local", path=data, limit=num_examples + 10, eval_size=10, seed=seed)
    return prepare_data(cfg, load_tokenizer(model_path)).train


def make_trl_trainer(model_path: str, rows, shapes: dict, precision: str, seed: int, workdir: str):
    """``SFTTrainer`` with ``SFTConfig``'s defaults plus the CPU flags and the shared shapes."""
    from trl import SFTConfig, SFTTrainer

    from posttrain.models.loading import load_model_and_tokenizer
    from posttrain.training.sft import sft_dataset
    from posttrain.training.stage_run import precision_flags

    model, tokenizer = load_model_and_tokenizer(model_path, "fp32", for_training=True)
    args = SFTConfig(
        output_dir=workdir,
        **precision_flags(precision),
        seed=seed,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        **shapes,
    )
    return SFTTrainer(model=model, args=args, train_dataset=sft_dataset(rows), processing_class=tokenizer)


def make_posttrain_trainer(
    model_path: str, rows, shapes: dict, precision: str, seed: int, workdir: str, variant: str
):
    """The SFT stage's trainer (``make_sft_trainer``), with one ablation's TRL options on top."""
    from posttrain.core.config import ModelConfig, SFTStageConfig
    from posttrain.training.sft import make_sft_trainer
    from posttrain.training.stage_run import StageContext

    options = {k: v for k, v in ABLATIONS[variant].items() if k != "compact_head"}
    stage = SFTStageConfig(trainer={**shapes, "save_strategy": "no", "disable_tqdm": True, **options})
    ctx = StageContext(
        stage="sft-bench", work_dir=Path(workdir), precision=precision, seed=seed, report_to="none"
    )
    model_cfg = ModelConfig(name=model_path, precision=precision)
    trainer, _, _ = make_sft_trainer(stage, model_cfg, model_path, rows, ctx)
    return trainer


def compact_head(variant: str) -> bool:
    """Whether ``variant`` trains with posttrain's compact LM head (process-wide, set on each turn)."""
    return variant != "trl" and ABLATIONS[variant].get("compact_head", True)


def run_variants(
    variants: Sequence[str],
    build: Callable[[str, str], object],
    seed: int,
    warmup: int,
    blocks: Sequence[int],
) -> dict[str, Measured]:
    """Build each variant's trainer (``build(name, workdir)``), train them taking turns, and return
    what their timed steps did (the first ``warmup`` steps of each are not counted)."""
    from posttrain.training.trl_compat import compact_fused_head_on_cpu

    turns = Turns(variants)
    trainers, timers, counters = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in variants:
            trainer = build(name, str(Path(tmp) / name))
            counters[name] = trainer.data_collator = CountingCollator(trainer.data_collator)
            timers[name] = TakeTurns(
                name,
                turns,
                [warmup, *blocks],
                lambda n=name: compact_fused_head_on_cpu(compact_head(n)),
                seed,
            )
            trainer.add_callback(timers[name])
            trainer.remove_callback(PrinterCallback)  # the trainers' log lines would bury the report
            trainers[name] = trainer
        errors: dict[str, BaseException] = {}

        def train(name: str) -> None:
            try:
                trainers[name].train()
            except BaseException as exc:  # reported by the main thread
                errors[name] = exc
            finally:
                turns.pass_on(name, finished=True)

        threads = [threading.Thread(target=train, args=(n,), name=f"sft-{n}") for n in variants]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        name, exc = next(iter(errors.items()))
        raise RuntimeError(f"variant {name} failed: {exc!r}") from exc
    results = {}
    for name in variants:
        timer, counter = timers[name], counters[name]
        steps = len(timer.walls)
        results[name] = Measured(
            wall=timer.walls[warmup:],
            cpu=timer.cpus[warmup:],
            tokens=counter.tokens[warmup:steps],
            positions=counter.positions[warmup:steps],
            warmup=sum(timer.walls[:warmup]),
        )
    return results


def report(name: str, measured: Measured, params: int, limit_gflops: float) -> str:
    """One variant's line: tokens/s (wall and CPU), padding, and the share of the matmul limit."""
    rate = measured.tokens_per_s()
    padding = 1 - sum(measured.tokens) / max(sum(measured.positions), 1)
    steps = ", ".join(f"{t:.1f}" for t in measured.wall)
    return (
        f"{name:16s} {rate:8.1f} tok/s, {measured.tokens_per_cpu_s():7.1f} tok per CPU-s "
        f"({statistics.mean(measured.tokens):.0f} real tokens/step, {padding:.0%} padding; "
        f"steps {steps} s; warm-up {measured.warmup:.1f} s); "
        f"{6 * params * rate / 1e9:.1f} GFLOP/s = {6 * params * rate / 1e9 / limit_gflops:.1%} of the matmul limit"
    )


def versus_trl(results: dict[str, Measured]) -> list[str]:
    """One line per variant: its tokens/s over TRL's (wall time, and CPU time, steadier under load).

    >>> versus_trl({"trl": Measured([2.0], [4.0], [100]), "posttrain": Measured([1.0], [3.0], [100])})
    ['posttrain / TRL defaults = 2.00x tokens/s (1.33x tokens per CPU-s)']
    """
    if "trl" not in results:
        return []
    base = results["trl"]
    return [
        f"{name} / TRL defaults = {m.tokens_per_s() / base.tokens_per_s():.2f}x tokens/s "
        f"({m.tokens_per_cpu_s() / base.tokens_per_cpu_s():.2f}x tokens per CPU-s)"
        for name, m in results.items()
        if name != "trl"
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="built-in name or model directory")
    parser.add_argument(
        "--tiny", action="store_true", help="the tiny random model and synthetic data (smoke run)"
    )
    parser.add_argument(
        "--data",
        default=str(GSM8K_TRAIN) if GSM8K_TRAIN.exists() else "synthetic",
        help="GSM8K-format .jsonl, or 'synthetic' (default: data/gsm8k/train.jsonl when present)",
    )
    parser.add_argument(
        "--steps", type=int, default=2, help="steps per variant per round (after 1 warm-up step)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="rounds of --steps steps per variant")
    parser.add_argument("--batch", type=int, default=8, help="per-device batch (rows)")
    parser.add_argument("--max-length", type=int, default=512)
    parser.add_argument("--precision", default="auto", help="posttrain's model.precision, for every variant")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--variants",
        default="trl,posttrain",
        help=f"comma list of trl and {', '.join(ABLATIONS)} (ablations of posttrain's settings)",
    )
    opts = parser.parse_args()

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if opts.threads:
        torch.set_num_threads(opts.threads)
    import datasets
    from transformers.utils import logging as hf_logging

    from posttrain.models.resolve import resolve_model_path
    from posttrain.models.tiny import build_tiny_model

    variants = opts.variants.split(",")
    unknown = [v for v in variants if v != "trl" and v not in ABLATIONS]
    if unknown:
        parser.error(f"unknown variants {unknown}: choose from trl, {', '.join(ABLATIONS)}")
    datasets.disable_progress_bars()
    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        if opts.tiny:  # built here, not in the models cache: a smoke run leaves nothing behind
            model_name, data, model_path = (
                "tiny (posttrain.models.tiny)",
                "synthetic",
                str(build_tiny_model(tmp)),
            )
        else:
            model_name, data, model_path = opts.model, opts.data, str(resolve_model_path(opts.model))
        measure(opts, model_name, model_path, data, variants)


def measure(
    opts: argparse.Namespace, model_name: str, model_path: str, data: str, variants: list[str]
) -> None:
    """Run the variants and print the report (``main`` without the argument parsing)."""
    from posttrain.models.hardware import resolve_dtype, resolve_precision

    precision = resolve_precision(opts.precision)
    total_steps = 1 + opts.repeats * opts.steps
    # Packed rows hold several examples each: keep enough rows that no variant starts a second epoch.
    rows = build_rows(model_path, data, 3 * opts.batch * total_steps, opts.seed)
    shapes = {
        "per_device_train_batch_size": opts.batch,
        "max_length": opts.max_length,
        "max_steps": total_steps,
    }

    def build(name: str, workdir: str):
        if name == "trl":
            return make_trl_trainer(model_path, rows, shapes, precision, opts.seed, workdir)
        return make_posttrain_trainer(model_path, rows, shapes, precision, opts.seed, workdir, name)

    dtype = resolve_dtype(precision)
    print(
        f"model {model_name}; data {data} ({len(rows)} rows); batch {opts.batch}, max_length {opts.max_length}, "
        f"precision {precision}; {opts.repeats} rounds of {opts.steps} steps per variant after 1 warm-up step; "
        f"torch threads {torch.get_num_threads()}; CPU {cpu_kind()}; "
        f"load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    limit = matmul_gflops(dtype)
    results = run_variants(variants, build, opts.seed, 1, [opts.steps] * opts.repeats)
    limit = max(limit, matmul_gflops(dtype))
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        params = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path)).num_parameters()
    print(
        f"matmul limit ({dtype}, best torch.matmul of the run): {limit:.1f} GFLOP/s; {params / 1e6:.1f}M parameters"
    )
    for name, measured in results.items():
        print(report(name, measured, params, limit))
    for line in versus_trl(results):
        print(line)
    print(f"load average now {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
