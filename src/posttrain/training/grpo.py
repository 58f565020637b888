"""One GRPO stage: TRL's GRPOTrainer with the stage's rewards, data slice and health monitor.

A GRPO run is a list of stages (e.g. ``format`` then ``correctness``), each its own call of
:func:`run_grpo_stage` starting from the previous stage's output directory, so each stage is
cached, evaluated and tracked on its own and a curriculum is just a different ``data_filter``.

Rewards come from the registry by name; their YAML weights become TRL's ``reward_weights``, so the
logged ``reward`` is the weighted sum while ``rewards/<name>/mean`` stays per reward. TRL writes
sampled completions with every reward's score as parquet on each logged step; the stage keeps
those of every ``sample_every``-th step (plus the first and the last) so a long run's output
directory stays small but still shows how the samples evolved.

Two stage options act inside TRL's loop: ``zero_signal`` (what happens to prompt groups whose
completions all scored the same; :mod:`posttrain.training.zero_signal`) and ``eval_every`` (greedy
accuracy on a held-out slice logged next to the reward; :mod:`posttrain.training.eval_callback`).

With a ``vllm_server:`` section, a stage in TRL's vLLM server mode (``use_vllm: true, vllm_mode:
server``) trains inside :func:`posttrain.generation.vllm_server.vllm_server`: the server is
started before the trainer is built and stopped when training ends or fails.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from posttrain.core.config import GRPOStageConfig, ModelConfig, VLLMServerConfig
from posttrain.core.errors import StageError
from posttrain.core.keep_best import selection_trainer_options
from posttrain.core.net import free_port
from posttrain.core.results import StageResult
from posttrain.data.pass_rates import PassRates, kept_ids, select_by_pass_rate
from posttrain.generation.vllm_server import ServerAddress, vllm_server
from posttrain.models.artifacts import adapter_root
from posttrain.models.resolve import resolve_model_path
from posttrain.training import distributed
from posttrain.training.eval_callback import heldout_slice
from posttrain.training.health import HealthCallback, HealthMonitor
from posttrain.training.selection import (
    attach_evaluation,
    eval_dataset_kwargs,
    records_dataset,
    selection_record,
)
from posttrain.training.stage_run import (
    StageContext,
    TrainOutcome,
    build_reward_funcs,
    execute_stage,
    load_policy,
    train_resumable,
    trainer_arguments,
)

logger = logging.getLogger(__name__)

__all__ = [
    "grpo_arguments",
    "grpo_options",
    "make_grpo_trainer",
    "prune_samples",
    "run_grpo_stage",
    "stage_prompts",
    "stage_vllm_server",
]

SAMPLES_DIR = "completions"
# Under the stage's trainer options (YAML and TRAINER_DEFAULTS win). Dropout is off because GRPO's
# importance ratio compares log-probabilities of the training forward with those of the sampling
# policy, which runs without dropout; on a CPU LoRA dropout is also a costly extra op per adapted layer.
GRPO_BASE_OPTIONS = {"disable_dropout": True}
_SAMPLE_RE = re.compile(r"completions_(\d+)\.parquet$")


def grpo_options(stage_cfg: GRPOStageConfig) -> dict[str, Any]:
    """The TRL options a stage trains with: base options, then TRAINER_DEFAULTS and YAML."""
    return {**GRPO_BASE_OPTIONS, **stage_cfg.trainer_options()}


def grpo_arguments(
    stage_cfg: GRPOStageConfig, ctx: StageContext, server: ServerAddress | None = None
) -> dict[str, Any]:
    """The keyword arguments of the stage's ``GRPOConfig`` (reward weights aside): its options, the
    keys posttrain manages, and a managed vLLM server's address. The address is not part of
    :func:`grpo_options`, so it never enters the stage's cache key or ``stage.json``.

    With a managed server, ``vllm_group_port`` (where the trainer hosts the NCCL group that pushes
    weights into the server) is a free port unless the stage sets it: TRL's fixed default 51216
    collides when two runs share a machine. The server needs no flag for it: in TRL 1.16 the
    client sends it as ``master_port`` in ``init_communicator``'s request.
    """
    options = grpo_options(stage_cfg)
    best = selection_trainer_options(
        "grpo", stage_cfg.keep, stage_cfg.eval_every, stage_cfg.select_metric, options
    )
    options = trainer_arguments(ctx, {**options, **best})
    if server is None:
        return options
    group_port = {} if "vllm_group_port" in options else {"vllm_group_port": free_port()}
    return {**options, **server.trainer_options(), **group_port}


@contextlib.contextmanager
def stage_vllm_server(
    server_cfg: VLLMServerConfig,
    model_cfg: ModelConfig,
    model_path: str,
    ctx: StageContext,
    *,
    command: Sequence[str] | None = None,
) -> Iterator[ServerAddress]:
    """The stage's managed vLLM server, started by the main process only (TRL's other ranks never
    talk to it), serving the model under the stage's input; its log is ``vllm_server.log`` in the
    stage's working folder (copied into the output)."""
    if not distributed.is_main_process():
        yield ServerAddress(server_cfg.host, server_cfg.port)
        return
    base = adapter_root(model_path) if Path(model_path).is_dir() else model_path
    served = resolve_model_path(base, model_cfg.cache_dir)
    revision = model_cfg.revision if not Path(served).is_dir() else None
    log = ctx.work_dir / "vllm_server.log"
    with vllm_server(server_cfg, served, log, revision=revision, command=command) as address:
        yield address


def stage_prompts(stage_cfg: GRPOStageConfig, dataset: Any, pass_rates: PassRates | None, seed: int) -> Any:
    """The prompts a stage trains on: its ``data_filter`` slice, then, with ``pass_rate:``, the scored
    prompts whose pass rate lies in its band (:func:`posttrain.data.pass_rates.select_by_pass_rate`)."""
    from posttrain.data.prepare import select_stage_data  # heavy: datasets

    stage = stage_cfg.step_name
    data = select_stage_data(dataset, stage_cfg.data_filter)
    if stage_cfg.pass_rate is None:
        return data
    if pass_rates is None:
        raise StageError(f"[{stage}] pass_rate: the stage needs its score-{stage} step's pass rates")
    kept = select_by_pass_rate(data, pass_rates, stage_cfg.pass_rate, seed)
    low, high = stage_cfg.pass_rate.band
    if len(kept) == 0:
        raise StageError(
            f"[{stage}] pass_rate: none of the {len(pass_rates.correct)} scored prompts has a pass rate "
            f"strictly between {low} and {high} (histogram by correct completions: "
            f"{pass_rates.histogram()}); widen the band or score more candidates"
        )
    logger.info(
        "[%s] %d of %d scored prompts have a pass rate strictly between %s and %s (%s weighting)",
        stage,
        len(kept_ids(pass_rates, stage_cfg.pass_rate)),
        len(pass_rates.correct),
        low,
        high,
        stage_cfg.pass_rate.weighting,
    )
    return kept


def prune_samples(directory: Path, every: int) -> list[str]:
    """Keep the sample files of the first step, every ``every``-th step and the last; return them sorted."""
    folder = directory / SAMPLES_DIR
    if not folder.is_dir():
        return []
    files = {int(m.group(1)): p for p in folder.iterdir() if (m := _SAMPLE_RE.search(p.name))}
    if not files:
        return []
    keep = {min(files), max(files)} | {step for step in files if step % every == 0}
    for step, path in files.items():
        if step not in keep:
            path.unlink(missing_ok=True)  # another rank may have pruned it first
    return [f"{SAMPLES_DIR}/{files[step].name}" for step in sorted(keep)]


def make_grpo_trainer(
    stage_cfg: GRPOStageConfig,
    model_cfg: ModelConfig,
    model_path: str,
    train_dataset: Any,
    ctx: StageContext,
    *,
    fast_generation: bool = True,
    callbacks: Sequence[Any] = (),
    heldout: Any = None,
    server: ServerAddress | None = None,
    pass_rates: PassRates | None = None,
):
    """The configured trainer and its health callback, ready to ``train()`` (shared with the benchmark).

    With ``fast_generation`` on a CPU, rollouts come from a shadow copy of the policy in the stage's
    precision through posttrain's generation engine (TRL's public ``rollout_func``): finished rows
    leave the batch, which saves most on short, uneven completions (benchmarks/grpo_step.py compares
    it with TRL's own generation). Settings
    the engine does not reproduce leave TRL's own generation in place (see posttrain.generation.rollout).
    ``heldout`` (the prepared data's selection slice, else its held-out records) feeds the stage's
    ``eval_every`` evaluation, which ``keep: best`` chooses the output checkpoint by.
    ``server`` is a running vLLM server for TRL's server mode (see :func:`stage_vllm_server`).
    ``pass_rates`` are the stage's scored prompts (``pass_rate:``, see :func:`stage_prompts`).
    """
    from trl import GRPOConfig

    from posttrain.core.library_policy import import_named
    from posttrain.generation.rollout import ShadowRollout, shadow_rollout_blockers
    from posttrain.generation.tools import tool_functions
    from posttrain.models.hardware import resolve_dtype
    from posttrain.training.console import quiet_console
    from posttrain.training.trl_compat import (
        compact_fused_head_on_cpu,
        new_grpo_trainer,
        no_completion_tables,
    )

    compact_fused_head_on_cpu()
    no_completion_tables()
    stage = f"grpo-{stage_cfg.name}"
    data = stage_prompts(stage_cfg, train_dataset, pass_rates, ctx.seed)
    reward_funcs, weights = build_reward_funcs(stage_cfg.rewards)
    model, tokenizer, peft_config = load_policy(model_cfg, model_path)
    args = GRPOConfig(**grpo_arguments(stage_cfg, ctx, server), reward_weights=weights)
    monitor = HealthCallback(HealthMonitor(stage_cfg.monitor), stage_cfg.monitor.on_alert, stage)
    chat_tools = stage_cfg.tool_protocol == "chat" and stage_cfg.uses_tools()
    inline_tools = stage_cfg.tools if stage_cfg.tool_protocol == "inline" else []
    trl_tools: dict[str, Any] = {}
    if chat_tools:  # TRL's own tool loop: TRL generates (shadow_rollout_blockers says "tools")
        trl_tools["tools"] = tool_functions(stage_cfg.tools) or None
        if stage_cfg.environment_factory:
            trl_tools["environment_factory"] = import_named(
                stage_cfg.environment_factory, "environment factory"
            )
    records = None
    if stage_cfg.eval_every is not None:
        if heldout is None and stage_cfg.keep == "best":
            raise StageError(f"[{stage}] keep: best needs the selection slice (data.selection_size)")
        if heldout is None:
            logger.warning("[%s] eval_every is set but no held-out data was given: not evaluating", stage)
        else:
            # already in the stage's data_filter range: the plan cuts it (steps.in_training_records)
            records = heldout_slice(heldout, None, stage_cfg.eval_limit)
    rollout, generation = None, "TRL"
    if inline_tools or (fast_generation and args.use_cpu):
        blockers = shadow_rollout_blockers(
            args, columns=data.column_names, tools=("chat",) if chat_tools else ()
        )
        if blockers and inline_tools:
            raise StageError(
                f"[{stage}] tools: {', '.join(stage_cfg.tools)} runs in posttrain's engine, which this stage "
                f"cannot generate with: {', '.join(blockers)}"
            )
        if blockers:
            generation = f"TRL (shadow rollout off: {', '.join(blockers)})"
        else:
            rollout = ShadowRollout(resolve_dtype(ctx.precision), inline_tools, log_metrics=_log_trl_metrics)
            generation = f"{ctx.precision}-shadow" + (
                f" with {', '.join(inline_tools)}" if inline_tools else ""
            )
    if chat_tools:
        generation += (
            f", TRL's tool calling with {', '.join(stage_cfg.tools) or stage_cfg.environment_factory}"
        )
    trainer = new_grpo_trainer(
        rollout_func=rollout,
        zero_signal=stage_cfg.zero_signal,
        max_rounds=stage_cfg.zero_signal_max_rounds,
        retire_after=stage_cfg.zero_signal_retire_after,
        refreshed=stage_cfg.refreshes_pool(),
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[monitor, *callbacks],
        **trl_tools,
        **(eval_dataset_kwargs(stage_cfg, records_dataset(records)) if records else {}),
    )
    quiet_console(trainer)
    refresh = None
    if stage_cfg.refreshes_pool():
        refresh = attach_pool_refresh(trainer, stage_cfg, train_dataset, data, seed=ctx.seed)
    if getattr(trainer, "_posttrain_sampler", None) is not None:
        from posttrain.training.pool_state import PoolCheckpoint

        trainer.add_callback(PoolCheckpoint(trainer._posttrain_sampler, refresh, stage=stage))
    evaluation = "off"
    if records:
        attach_evaluation(trainer, stage_cfg, records, stage=stage)
        evaluation = f"{len(records)} questions every {stage_cfg.eval_every} steps" + (
            f", keeping the best checkpoint by {stage_cfg.select_metric}" if stage_cfg.keep == "best" else ""
        )
    logger.info(
        "[%s] %d examples, rewards %s (weights %s), %s generation, zero_signal %s, evaluation %s",
        stage,
        len(data),
        [getattr(f, "__name__", "?") for f in reward_funcs],
        weights,
        generation,
        stage_cfg.zero_signal,
        evaluation,
    )
    return trainer, monitor


def attach_pool_refresh(
    trainer: Any, stage_cfg: GRPOStageConfig, train_dataset: Any, pool: Any, *, seed: int
) -> Any:
    """Re-score the stage's pool and outside candidates every ``pass_rate.refresh_every`` steps
    (:mod:`posttrain.training.pool_refresh`); ``pool`` is what the stage trains on at the start.
    Returns the refresh callback."""
    from posttrain.data.prepare import select_stage_data  # heavy: datasets
    from posttrain.training.pool_refresh import PoolRefresh

    candidates = select_stage_data(train_dataset, stage_cfg.data_filter)
    stage = f"grpo-{stage_cfg.name}"
    refresh = PoolRefresh(
        trainer, candidates, [str(pid) for pid in pool["id"]], stage_cfg, seed=seed, stage=stage
    )
    trainer.add_callback(refresh)
    return refresh


def _log_trl_metrics(trainer: Any, metrics: dict[str, float]) -> None:
    from posttrain.training.trl_compat import trl_metric

    for name, value in metrics.items():
        trl_metric(trainer, name, value)


def run_grpo_stage(
    stage_cfg: GRPOStageConfig,
    model_cfg: ModelConfig,
    model_path: str | Path,
    train_dataset: Any,
    output_dir: str | Path,
    *,
    seed: int = 0,
    report_to: str | list[str] = "none",
    fast_generation: bool = True,
    heldout: Any = None,
    vllm_server_cfg: VLLMServerConfig | None = None,
    server_command: Sequence[str] | None = None,
    pass_rates: PassRates | None = None,
) -> StageResult:
    """Train one GRPO stage from ``model_path`` on prepared data (``prompt`` messages + ``answer``).

    ``heldout`` is what the stage evaluates during training when it sets ``eval_every``: the prepared
    data's selection slice (``data.selection_size``), else its held-out split.

    ``fast_generation`` samples rollouts from a copy of the policy through posttrain's engine when
    training on a CPU (see posttrain.generation.rollout); it is a no-op elsewhere. Health alerts end up in the result and in
    ``stage.json``; with ``monitor.on_alert: stop`` the first alert ends training (the policy
    trained so far is still saved, so the run can be inspected).

    ``vllm_server_cfg`` (the config's ``vllm_server:``) makes posttrain run the stage's vLLM server
    when its options select TRL's server mode; ``server_command`` replaces ``trl vllm-serve`` (tests).
    ``pass_rates`` (the stage's ``score-<stage>`` step) choose its prompts when it sets ``pass_rate:``.
    """
    options = grpo_options(stage_cfg)

    def train(ctx: StageContext) -> TrainOutcome:
        with contextlib.ExitStack() as stack:
            server = None
            if vllm_server_cfg is not None and stage_cfg.uses_vllm_server():
                server = stack.enter_context(
                    stage_vllm_server(
                        vllm_server_cfg, model_cfg, str(model_path), ctx, command=server_command
                    )
                )
            trainer, monitor = make_grpo_trainer(
                stage_cfg,
                model_cfg,
                str(model_path),
                train_dataset,
                ctx,
                fast_generation=fast_generation,
                heldout=heldout,
                server=server,
                pass_rates=pass_rates,
            )
            output = train_resumable(trainer, ctx)
        return TrainOutcome.from_trainer(
            trainer,
            output,
            metrics={"train_examples": len(trainer.train_dataset), "alerts": len(monitor.alerts)},
            alerts=monitor.alerts,
            samples=prune_samples(ctx.work_dir, stage_cfg.sample_every),
            selection=selection_record(stage_cfg, trainer),
        )

    return execute_stage(
        stage=f"grpo-{stage_cfg.name}",
        kind="grpo",
        stage_cfg=stage_cfg,
        model_cfg=model_cfg,
        model_path=model_path,
        train_dataset=train_dataset,
        output_dir=output_dir,
        seed=seed,
        report_to=report_to,
        options=options,
        train_fn=train,
    )
