"""Keeping a GRPO stage's prompt pool fresh while it trains (``pass_rate.refresh_every``).

The ``score-<stage>`` step measures pass rates under the model the stage starts from. The policy
moves as it trains: a prompt it sometimes solved at step 0 may be always solved by step 8, and a
prompt it never solved may now be in reach. Every ``refresh_every`` steps :class:`PoolRefresh`
scores ``refresh_size`` prompts again with the policy as it is (k completions each, at the stage's
temperature, completion length and tools, through the engine that evaluates the stage, on the
rollouts' shadow copy where there is one; each completion paid or not by the ``correctness``
reward, as the scoring step counts):

* up to half are the pool's own prompts, least recently scored first; one whose pass rate has left
  the band leaves the stage (:meth:`DynamicSampler.retire`: its groups are swapped for fresh
  prompts before generation, as ``zero_signal_retire_after`` does);
* the rest are candidates of the stage's data outside the pool, in a seeded order that comes round
  again; one whose pass rate is inside the band joins the pool and is drawn before any other fresh
  prompt (:meth:`FreshPrompts.admit`): it becomes the stand-in of the next retired prompt to come
  round (trained whenever that one would have been), or fills a flat group in a resample round.

Each refresh logs what left and what joined (ids, at INFO) and the step's ``pass_rate/*`` metrics
(:data:`METRICS`). The scoring seeds are derived from the run's seed and the step, and no random
number is drawn from torch's global generator, so the rollouts' own randomness is untouched.

On several processes each rank samples its share (a contiguous slice, near equal) of the k x
``refresh_size`` completions, with the seeds those completions have in one process, and the scores
are gathered, so every rank takes the same decisions and the pool stays one pool. That needs the whole policy on each rank: a stage
whose policy is sharded (FSDP, ZeRO-3) is refused when the trainer is built.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import TrainerCallback

from posttrain.core.config import GRPOStageConfig
from posttrain.core.errors import StageError
from posttrain.data.pass_rates import correct_counts
from posttrain.generation.engine import generate_continuous, pad_token_id, stop_token_ids
from posttrain.generation.sampling import sample_seeds
from posttrain.generation.tools import make_tool
from posttrain.rewards.accuracy import correctness_reward
from posttrain.training.eval_callback import BATCH_SIZE, completion_texts, encode_records, generation_model
from posttrain.training.sharded import planned_sharding

logger = logging.getLogger(__name__)

__all__ = ["METRICS", "PoolRefresh"]

METRICS = (
    "pass_rate/pool",
    "pass_rate/refresh_scored",
    "pass_rate/refresh_left",
    "pass_rate/refresh_joined",
    "pass_rate/refresh_seconds",
)


class PoolRefresh(TrainerCallback):
    """Re-scores part of ``trainer``'s prompt pool and outside candidates every ``refresh_every`` steps.

    ``candidates`` are the stage's data (after ``data_filter``), ``pool`` the ids the scoring step
    kept. ``trainer`` is posttrain's dynamic-sampling GRPO trainer (its ``_posttrain_sampler``).
    """

    def __init__(
        self,
        trainer: Any,
        candidates: Sequence[Mapping[str, Any]] | Any,
        pool: Sequence[str],
        stage_cfg: GRPOStageConfig,
        *,
        seed: int,
        stage: str = "grpo",
    ) -> None:
        cfg = stage_cfg.pass_rate
        assert cfg is not None and cfg.refresh_every is not None, "only a stage with pass_rate.refresh_every"
        self.trainer, self.cfg, self.stage_cfg, self.seed, self.stage = trainer, cfg, stage_cfg, seed, stage
        self.sampler = trainer._posttrain_sampler
        if kind := planned_sharding(trainer.accelerator):
            raise StageError(
                f"[{stage}] pass_rate.refresh_every: the pool refresh generates with the whole policy on "
                f"each process, and this stage shards it ({kind}); train it with DDP or leave "
                f"refresh_every unset"
            )
        self.ranks = trainer._posttrain_ranks
        self.rows = [dict(candidates[i]) for i in range(len(candidates))]
        self.scored_at: dict[str, int] = {str(pid): 0 for pid in dict.fromkeys(pool)}
        """The pool: each prompt's id → the step it was last scored at."""
        in_pool = set(self.scored_at)
        outside = [i for i, row in enumerate(self.rows) if str(row["id"]) not in in_pool]
        order = torch.randperm(len(outside), generator=torch.Generator().manual_seed(seed)).tolist()
        self.outside = [outside[i] for i in order]
        """Indices into ``rows`` of the candidates outside the starting pool, in the order they are tried."""
        self.cursor = 0
        self.history: list[dict[str, Any]] = []

    @property
    def rows_by_id(self) -> dict[str, dict[str, Any]]:
        """The stage's candidates by id (what an admitted prompt's id stands for)."""
        return {str(row["id"]): row for row in self.rows}

    def state(self) -> dict[str, Any]:
        """The pool, where the outside order stands and the refreshes so far, as JSON values."""
        # Pairs, not an object: the order breaks ties between prompts last scored at the same step,
        # and transformers writes the trainer state with sorted keys.
        pool = [[pid, step] for pid, step in self.scored_at.items()]
        return {"scored_at": pool, "cursor": self.cursor, "history": list(self.history)}

    def restore(self, state: Mapping[str, Any], steps: int) -> None:
        """Go back to a :meth:`state` read from a checkpoint at step ``steps`` (checked against the
        stage's candidates; ValueError if malformed)."""
        scored_at, cursor, history = state.get("scored_at"), state.get("cursor"), state.get("history")
        known = self.rows_by_id
        if not isinstance(scored_at, list) or not all(
            isinstance(pair, list)
            and len(pair) == 2
            and isinstance(pair[0], str)
            and pair[0] in known
            and type(pair[1]) is int
            and 0 <= pair[1] <= steps
            for pair in scored_at
        ):
            raise ValueError("pool refresh: scored_at must pair candidate ids with steps already trained")
        if type(cursor) is not int or not 0 <= cursor < max(1, len(self.outside)):
            raise ValueError(f"pool refresh: cursor {cursor!r} out of range")
        if (
            not isinstance(history, list)
            or len(history) > steps
            or not all(isinstance(r, dict) for r in history)
        ):
            raise ValueError("pool refresh: history must hold one record per refresh so far")
        self.scored_at = {pid: step for pid, step in scored_at}
        self.cursor, self.history = cursor, list(history)

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step
        if step % self.cfg.refresh_every == 0 and step < state.max_steps:
            self.refresh(step)
        return control

    def refresh(self, step: int) -> dict[str, Any]:
        """Score, retire and admit (see the module docstring); the refresh's record."""
        start = time.perf_counter()
        retired = set(self.sampler.retired)
        for pid in [p for p in self.scored_at if p in retired]:  # left by zero_signal_retire_after
            del self.scored_at[pid]
        own = sorted(self.scored_at, key=lambda pid: self.scored_at[pid])[: self.cfg.refresh_size // 2]
        by_id = self.rows_by_id
        rows = [by_id[pid] for pid in own] + self._outside(self.cfg.refresh_size - len(own), retired)
        correct = self.score(rows, step)
        left, joined = [], []
        for row in rows:
            pid, rate = str(row["id"]), correct[str(row["id"])] / self.cfg.samples
            if pid in self.scored_at:
                self.scored_at[pid] = step
                if not self.cfg.keeps(rate):
                    del self.scored_at[pid]
                    self.sampler.retire(pid, f"pass rate {rate:.2f} at the pool refresh of step {step}")
                    left.append(pid)
            elif self.cfg.keeps(rate):
                self.scored_at[pid] = step
                joined.append(row)
        self.sampler.fresh.admit(joined)
        seconds = time.perf_counter() - start
        record = {
            "step": step,
            "scored": len(rows),
            "left": left,
            "joined": [str(row["id"]) for row in joined],
            "pool": len(self.scored_at),
            "seconds": round(seconds, 3),
        }
        self.history.append(record)
        values = (len(self.scored_at), len(rows), len(left), len(joined), seconds)
        for name, value in zip(METRICS, values, strict=True):
            self.trainer._metrics["train"][name].append(float(value))
        logger.info(
            "[%s] step %d pool refresh: %d prompts scored in %.1f s; %d left %s, %d joined %s; pool %d",
            self.stage,
            step,
            len(rows),
            seconds,
            len(left),
            left,
            len(joined),
            record["joined"],
            len(self.scored_at),
        )
        return record

    def _outside(self, count: int, retired: set[str]) -> list[dict[str, Any]]:
        """The next ``count`` candidates outside the pool (and not retired), going round the order."""
        rows: list[dict[str, Any]] = []
        for _ in range(len(self.outside)):
            if len(rows) == count:
                break
            row = self.rows[self.outside[self.cursor]]
            self.cursor = (self.cursor + 1) % len(self.outside)
            pid = str(row["id"])
            if pid not in self.scored_at and pid not in retired:
                rows.append(row)
        return rows

    def score(self, rows: Sequence[Mapping[str, Any]], step: int) -> dict[str, int]:
        """Correct completions of k sampled for each row by the policy at ``step``, by id."""
        if not rows:
            return {}
        k, ranks, options = self.cfg.samples, self.ranks, self.stage_cfg.trainer_options()
        everyone = [dict(row) for row in rows for _ in range(k)]
        seeds = sample_seeds(self.seed * 100_003 + step, len(everyone))
        first, last = (len(everyone) * i // ranks.count for i in (ranks.index, ranks.index + 1))
        requests = everyone[first:last]  # this rank's share: the others score the rest
        scores = self._correct(requests, seeds[first:last], step, options) if requests else []
        scores = ranks.gather_list(scores)
        grouped = [scores[i * k : (i + 1) * k] for i in range(len(rows))]
        return correct_counts([str(row["id"]) for row in rows], grouped)

    def _correct(
        self, requests: list[dict[str, Any]], seeds: list[int], step: int, options: Mapping[str, Any]
    ) -> list[float | None]:
        """The ``correctness`` reward of one completion per request, sampled with its seed."""
        trainer, tokenizer = self.trainer, self.trainer.processing_class
        model = generation_model(trainer, step)
        tool = make_tool(
            self.stage_cfg.tools,
            self.stage_cfg.tool_protocol,
            tokenizer,
            stop_ids=sorted(stop_token_ids(model, tokenizer)),
            environment_factory=self.stage_cfg.environment_factory,
            rows=requests,
            template_kwargs=getattr(trainer.args, "chat_template_kwargs", None) or {},
        )
        prompts = encode_records(
            tokenizer, requests, tool, getattr(trainer.args, "chat_template_kwargs", None) or {}
        )
        was_training = model.training
        model.eval()
        try:
            completions, _ = generate_continuous(
                model,
                prompts,
                max_new_tokens=int(options["max_completion_length"]),
                stop_ids=stop_token_ids(model, tokenizer),
                pad_token_id=pad_token_id(tokenizer),
                batch_size=min(BATCH_SIZE, len(prompts)),
                temperature=float(options.get("temperature", 1.0)),
                seeds=seeds,
            )
        finally:
            model.train(was_training)
        texts = completion_texts(tokenizer, completions, tool)
        return correctness_reward(texts, [row["answer"] for row in requests])
