"""DPO on on-policy preference pairs: sample from the current policy, score, prefer the best.

Pairs come from the model being trained (not from a fixed preference set) so the loss pushes
against the mistakes this model actually makes. For each of ``num_prompts`` prompts the input policy
samples ``num_generations`` completions; each is scored with the stage's rewards (weighted sum,
the same functions GRPO uses) and checked for a correct final answer with the evaluator's parser.
``data.builders.build_dpo_dataset`` then picks chosen = best and rejected = worst, falls back to the
reference solution as chosen when no sample is correct, and drops groups whose scores all tie.

With LoRA, TRL uses the adapter-disabled model as the DPO reference, i.e. this stage's input policy;
with full fine-tuning a frozen copy of it is passed explicitly.

A stage resumed after a kill trains on the pairs the interrupted run sampled (kept in its working
folder with their statistics), not on a new sample: the trainer's checkpoint counts positions in
that dataset, and sampling need not repeat exactly on another device.

With ``eval_every`` the stage answers a slice of the selection (else held-out) records greedily as
it trains, and with ``keep: best`` its output is the checkpoint that answered best
(:mod:`posttrain.training.selection`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from posttrain.core.config import DPOStageConfig, ModelConfig
from posttrain.core.errors import StageError
from posttrain.core.keep_best import selection_trainer_options
from posttrain.core.parsing import answers_match, parse_strict
from posttrain.core.prompts import format_sft_target
from posttrain.core.results import StageResult
from posttrain.generation.sampling import Samples, sample_completions
from posttrain.models.loading import load_stage_model
from posttrain.training import distributed
from posttrain.training.selection import attach_evaluation, evaluation_records, selection_record
from posttrain.training.stage_run import (
    StageContext,
    TrainOutcome,
    build_reward_funcs,
    execute_stage,
    frozen_reference,
    load_policy,
    train_resumable,
    trainer_arguments,
)

logger = logging.getLogger(__name__)

__all__ = ["PAIRS_FILE", "PAIRS_STATS_FILE", "run_dpo", "score_samples"]

PAIRS_FILE = "dpo_pairs.jsonl"
PAIRS_STATS_FILE = "dpo_pairs_stats.json"


def score_samples(
    rows: list[dict[str, Any]], samples: Samples, reward_funcs: list[Any], weights: list[float]
) -> tuple[list[list[float]], list[list[bool]]]:
    """Weighted reward sum and strict correctness for every sampled completion.

    Rewards are called the way TRL calls them (conversational completions plus every dataset column
    as a keyword), so a reward behaves identically in DPO sampling and in GRPO. ``None`` scores 0.
    """
    scores, correct = [], []
    for row, texts, ids in zip(rows, samples.texts, samples.token_ids, strict=True):
        n = len(texts)
        completions = [[{"role": "assistant", "content": t}] for t in texts]
        columns = {k: [v] * n for k, v in row.items() if k != "prompt"}
        total = [0.0] * n
        for func, weight in zip(reward_funcs, weights, strict=True):
            values = func(prompts=[row["prompt"]] * n, completions=completions, completion_ids=ids, **columns)
            total = [
                t + weight * (float(v) if v is not None else 0.0) for t, v in zip(total, values, strict=True)
            ]
        scores.append(total)
        correct.append([answers_match(parse_strict(t), row.get("answer")) for t in texts])
    return scores, correct


def _select_prompts(dataset: Any, num_prompts: int, seed: int) -> list[dict[str, Any]]:
    ds = dataset.shuffle(seed=seed) if len(dataset) > num_prompts else dataset
    return [dict(r) for r in ds.select(range(min(num_prompts, len(ds))))]


def _build_pairs(
    dpo_cfg: DPOStageConfig,
    model_cfg: ModelConfig,
    model_path: str,
    rows: list[dict[str, Any]],
    seed: int,
    work_dir: Path,
):
    from posttrain.data.builders import build_dpo_dataset

    reward_funcs, weights = build_reward_funcs(dpo_cfg.rewards)
    policy, tokenizer = load_stage_model(
        model_path,
        model_cfg.precision,
        model_cfg.cache_dir,
        attn_implementation=model_cfg.attn_implementation,
    )
    samples = sample_completions(
        policy,
        tokenizer,
        [r["prompt"] for r in rows],
        dpo_cfg.num_generations,
        temperature=dpo_cfg.temperature,
        max_new_tokens=dpo_cfg.max_completion_length,
        seed=seed,
        tools=dpo_cfg.tools,
    )
    del policy
    scores, correct = score_samples(rows, samples, reward_funcs, weights)
    calculator = "calculator" in dpo_cfg.tools
    references = [
        format_sft_target(r["solution"], calculator=True)
        if calculator and r.get("solution")
        else r.get("solution")
        for r in rows
    ]
    pairs, stats = build_dpo_dataset([r["prompt"] for r in rows], samples.texts, scores, correct, references)
    flat_scores = [s for group in scores for s in group]
    flat_correct = [c for group in correct for c in group]
    metrics = {f"pairs/{k}": v for k, v in stats.items()}
    metrics.update(
        {
            "sampling/mean_score": sum(flat_scores) / len(flat_scores),
            "sampling/correct_rate": sum(flat_correct) / len(flat_correct),
            "sampling/seconds": round(samples.seconds, 3),
            "sampling/tokens_per_second": round(samples.generated_tokens / max(samples.seconds, 1e-9), 2),
            **({f"sampling/{k}": v for k, v in samples.tool_metrics().items()} if dpo_cfg.tools else {}),
        }
    )
    if len(pairs) == 0:
        raise StageError(
            f"DPO: no preference pairs from {len(rows)} prompts (every group tied on "
            f"{[getattr(f, '__name__', '?') for f in reward_funcs]}); raise num_generations or "
            "temperature, or add rewards that separate completions"
        )
    logger.info("DPO pairs: %s", stats)
    with (work_dir / PAIRS_FILE).open("w") as fh:
        for pair in pairs:
            fh.write(json.dumps(pair) + "\n")
    # Written last: its presence says the pairs file beside it is complete.
    (work_dir / PAIRS_STATS_FILE).write_text(json.dumps(metrics, indent=1))
    return pairs, metrics


def _saved_pairs(work_dir: Path):
    """The pairs and pair metrics an interrupted run of this stage sampled, or None."""
    from datasets import Dataset  # heavy: deferred until needed

    from posttrain.data.builders import DPO_FEATURES  # imports datasets

    try:
        metrics = json.loads((work_dir / PAIRS_STATS_FILE).read_text(encoding="utf-8"))
        lines = (work_dir / PAIRS_FILE).read_text(encoding="utf-8").splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError):
        return None
    columns = {name: [row[name] for row in rows] for name in ("prompt", "chosen", "rejected")}
    return Dataset.from_dict(columns, features=DPO_FEATURES), metrics


def run_dpo(
    dpo_cfg: DPOStageConfig,
    model_cfg: ModelConfig,
    model_path: str | Path,
    train_dataset: Any,
    output_dir: str | Path,
    *,
    seed: int = 0,
    report_to: str | list[str] = "none",
    selection: Any = None,
    eval_max_new_tokens: int | None = None,
) -> StageResult:
    """Sample on-policy pairs from ``model_path`` on prepared data, then train DPO on them.

    ``train_dataset`` needs ``prompt`` (messages) and ``answer``; ``solution`` (a GSM8K worked
    solution) is used as the chosen answer for prompts the model got wrong. The pairs are kept in
    ``dpo_pairs.jsonl`` and their statistics (``pairs/*``, ``sampling/*``) in the result metrics.
    ``selection`` is what ``eval_every`` evaluates (and ``keep: best`` chooses by), generating up to
    ``eval_max_new_tokens``.
    """
    options = dpo_cfg.trainer_options()
    records = None
    if dpo_cfg.eval_every is not None:
        if selection is None and dpo_cfg.keep == "best":
            raise StageError("dpo: keep: best needs the selection slice (data.selection_size)")
        if selection is None:
            logger.warning("[dpo] eval_every is set but no evaluation records were given: not evaluating")
        else:
            records = evaluation_records(selection, dpo_cfg.eval_limit)
    best = selection_trainer_options("dpo", dpo_cfg.keep, dpo_cfg.eval_every, dpo_cfg.select_metric, options)

    def train(ctx: StageContext) -> TrainOutcome:
        from trl import DPOConfig, DPOTrainer

        from posttrain.training.console import quiet_console
        from posttrain.training.trl_compat import carry_token_count, compact_fused_head_on_cpu

        compact_fused_head_on_cpu()
        saved = _saved_pairs(ctx.work_dir) if ctx.resume_from is not None else None
        if saved is None and not distributed.is_main_process():
            distributed.barrier()  # rank 0 samples the pairs; every rank trains on them
            saved = _saved_pairs(ctx.work_dir)
            if saved is None:
                raise StageError(f"DPO: rank {distributed.rank()} found no pairs in {ctx.work_dir}")
        if saved is not None:
            pairs, pair_metrics = saved
            logger.info("DPO: resuming on the %d pairs the interrupted run sampled", len(pairs))
        else:
            rows = _select_prompts(train_dataset, dpo_cfg.num_prompts, ctx.seed)
            pairs, pair_metrics = _build_pairs(
                dpo_cfg, model_cfg, str(model_path), rows, ctx.seed, ctx.work_dir
            )
            distributed.barrier()
        model, tokenizer, peft_config = load_policy(model_cfg, str(model_path))
        args = DPOConfig(**trainer_arguments(ctx, {**options, **best}))
        ref = {"ref_model": frozen_reference(model)} if peft_config is None else {}
        # keep: best evaluates on the trainer's schedule, which needs an eval_dataset; the
        # selection evaluation never reads it, and DPO rows are pairs: one of its own pairs.
        placeholder = {"eval_dataset": pairs.select(range(1))} if best else {}
        trainer = DPOTrainer(
            model=model,
            args=args,
            train_dataset=pairs,
            processing_class=tokenizer,
            peft_config=peft_config,
            **ref,
            **placeholder,
        )
        quiet_console(trainer)
        if records is not None:
            attach_evaluation(trainer, dpo_cfg, records, stage="dpo", max_new_tokens=eval_max_new_tokens)
        carry_token_count(trainer, ctx.resume_from)
        output = train_resumable(trainer, ctx)
        return TrainOutcome.from_trainer(
            trainer, output, tokenizer, metrics=pair_metrics, selection=selection_record(dpo_cfg, trainer)
        )

    return execute_stage(
        stage="dpo",
        kind="dpo",
        stage_cfg=dpo_cfg,
        model_cfg=model_cfg,
        model_path=model_path,
        train_dataset=train_dataset,
        output_dir=output_dir,
        seed=seed,
        report_to=report_to,
        options=options,
        train_fn=train,
    )
