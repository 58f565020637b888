"""Dynamic sampling for GRPO: what a stage does with prompt groups whose completions all scored the same.

GRPO's advantage is a completion's reward minus its group's mean (over the group's std with TRL's
default ``scale_rewards: group``). When every completion of a prompt earns the same reward (standard
deviation below :data:`ZERO_STD`, as the health monitor counts it) the group's advantages are zero: it
adds nothing to the policy gradient, yet it still counts in the loss normaliser (TRL's default ``dapo``
loss divides by every completion token of the batch) and, with ``beta`` > 0, still pulls towards the
reference. A 135M model on GSM8K gets nearly every group like that (the ``no_signal`` alert). A GRPO
stage's ``zero_signal`` option says what to do with them:

=========  ==================================================================================
keep       TRL as it ships (default; posttrain adds nothing to the loop).
drop       the flat groups' completions are masked out of the loss, the way TRL's
           ``mask_truncated_completions`` masks truncated ones, and the loss's token count is
           recounted, so the gradient is the mean over groups with signal. This changes the loss
           of the loss types that normalise by tokens (``dapo``, TRL's default, ``bnpo``,
           ``cispo``, ``vespo``); ``grpo`` and ``dr_grpo`` divide by a fixed number of sequences or
           tokens, so for them only the KL term of the dropped groups goes.
resample   DAPO's dynamic sampling (Yu et al. 2025, "DAPO", section 3.2): fresh prompts are drawn,
           generated and scored exactly as TRL does the step's own, and their groups with signal
           take the place of flat ones, for at most ``zero_signal_max_rounds`` extra rounds per
           generation batch; whatever is still flat after the budget is dropped as above (the
           fallback is drop, not keep). A round draws as many prompts as there are flat places
           left, divided by the share of groups with signal seen so far in the step (the whole
           batch while none had signal), so a nearly full batch costs a small round.
=========  ==================================================================================

With ``zero_signal_retire_after: N`` a prompt whose groups scored alike N times in a row (always
solved or never, by the policy as it is now) leaves the stage: before a batch is generated, a
retired prompt's group is swapped for its stand-in's, so no rollout is spent on it again, and
resample rounds skip it. The stand-in is a fresh prompt (a pool refresh's admitted prompts first),
chosen the first time the retired prompt comes round and kept for the times after, so an admitted
prompt trains whenever the prompt it replaced would have (a new one is chosen if it retires too).
Each retirement is logged with the prompt's id; ``zero_signal/prompts_retired`` and
``zero_signal/groups_replaced`` count them per step, and ``zero_signal/completions_per_useful_group``
says what a group with signal cost in completions.

Fresh prompts come from the stage's training data in an order of their own (:class:`FreshPrompts`,
seeded from the run's seed), independent of TRL's sampler: a resampled prompt may come round again
later in the epoch. What the sampler has decided (retired prompts and their stand-ins, runs of flat
groups, where the fresh order stands, prompts a pool refresh admitted) goes into every checkpoint
(posttrain.training.pool_state), so a resumed stage goes on as the uninterrupted one would.
``reward`` and the other TRL metrics of a step average over every round generated
(the policy's reward on the data, not on the selected groups); what was trained on is logged as
``zero_signal/frac_signal`` (share of the trained batch's groups with signal), ``zero_signal/groups_dropped``,
``zero_signal/groups_resampled`` and ``zero_signal/rounds`` (extra generation rounds).

Merging rounds re-pads their tensors to a common width (prompts on the left, completions on the
right, as TRL pads them). With rotary position embeddings (Llama, Qwen, SmolLM2) extra left padding
shifts a row's positions by a constant, which leaves attention unchanged, so log-probabilities
computed before the merge (``old_per_token_logps``, ``ref_per_token_logps``) still match.

On several processes every decision is taken on the whole generation batch, the same way on
each rank: TRL gathers the rewards of every rank's rows, the prompt ids are gathered too
(:class:`Ranks`), and the fresh-prompt order is seeded alike everywhere, so each rank retires, swaps
and draws exactly what the others do and keeps the same pool. A resample round's prompts are shared
out in equal slices (the round grows to a multiple of the ranks); a rank's trained rows may come
from another rank's round, so the rounds' batches are gathered before the merge and each rank takes
its own slice of the merged batch, which is the 1-process merge cut in ranks.

This module is plain tensor logic: :class:`DynamicSampler` runs on any ``generate(inputs)`` that
returns TRL's batch dict and the rewards per completion; the hook into ``GRPOTrainer`` lives in
:mod:`posttrain.training.trl_compat`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

__all__ = [
    "METRICS",
    "ZERO_STD",
    "DynamicSampler",
    "FreshPrompts",
    "Ranks",
    "ZeroSignalCounts",
    "drop_rows",
    "gather_batch",
    "group_signal",
    "recount_tokens",
    "round_size",
    "take_rows",
]

ZERO_STD = 1e-8
"""A group whose rewards differ by less than this has no usable advantage (fp noise, not signal)."""

METRICS = (
    "zero_signal/frac_signal",
    "zero_signal/groups_dropped",
    "zero_signal/groups_resampled",
    "zero_signal/rounds",
    "zero_signal/completions_per_useful_group",
    "zero_signal/prompts_retired",
    "zero_signal/groups_replaced",
)

# How TRL 1.16 lays out the batch `_generate_and_score_completions` returns, and the value that pads each
# tensor (None: the tokenizer's pad id). Other keys (images) cannot be merged across rounds.
LEFT_PADDED: dict[str, float | None] = {"prompt_ids": None, "prompt_mask": 0}
RIGHT_PADDED: dict[str, float | None] = {
    "completion_ids": None,
    "completion_mask": 0,
    "tool_mask": 1,
    "old_per_token_logps": 0.0,
    "ref_per_token_logps": 0.0,
    "sampling_per_token_logps": 0.0,
    "importance_sampling_ratio": 1.0,
}
PER_ROW = ("advantages",)
RECOUNTED = "num_items_in_batch"


def _group_std(values: torch.Tensor) -> torch.Tensor:
    """Standard deviation over the last dimension ignoring NaN, with Bessel's correction (TRL's
    ``nanstd``); NaN where fewer than two values are finite."""
    finite = ~torch.isnan(values)
    count = finite.sum(-1)
    filled = torch.where(finite, values, torch.zeros_like(values))
    mean = filled.sum(-1) / count.clamp(min=1)
    squares = torch.where(finite, (values - mean.unsqueeze(-1)) ** 2, torch.zeros_like(values)).sum(-1)
    std = (squares / (count - 1).clamp(min=1)).sqrt()
    return torch.where(count > 1, std, torch.full_like(std, float("nan")))


def group_signal(
    rewards_per_func: torch.Tensor,
    weights: Sequence[float] | torch.Tensor,
    num_generations: int,
    aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """Per prompt group (``num_generations`` consecutive rows): does it carry a gradient?

    ``rewards_per_func`` is TRL's ``(completions, reward functions)`` matrix (NaN: not scored). With
    TRL's default ``sum_then_normalize`` a group has signal when its weighted reward sums differ
    (standard deviation above :data:`ZERO_STD`); with ``normalize_then_sum`` when any weighted reward
    differs within it. Completions no reward could score are left out, as TRL leaves them out.

    >>> r = torch.tensor([[1.0], [1.0], [0.0], [1.0], [float("nan")], [2.0]])
    >>> group_signal(r, [1.0], 2).tolist()
    [False, True, False]
    >>> two = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # equal sums, different parts
    >>> group_signal(two, [1.0, 1.0], 2).tolist(), group_signal(two, [1, 1], 2, "normalize_then_sum").tolist()
    ([False], [True])
    """
    if rewards_per_func.dim() != 2 or rewards_per_func.shape[0] % num_generations:
        raise ValueError(
            f"rewards of shape {tuple(rewards_per_func.shape)} do not form groups of {num_generations}"
        )
    weighted = rewards_per_func.float() * torch.as_tensor(weights, dtype=torch.float32).to(
        rewards_per_func.device
    )
    if aggregation == "sum_then_normalize":
        total = torch.nansum(weighted, dim=1)
        total[torch.isnan(rewards_per_func).all(dim=1)] = float("nan")
        std = _group_std(total.view(-1, num_generations))
        return std > ZERO_STD  # NaN compares False: a group with fewer than two scores has none
    if aggregation == "normalize_then_sum":
        grouped = weighted.view(-1, num_generations, weighted.shape[1]).transpose(1, 2)
        return (_group_std(grouped) > ZERO_STD).any(dim=1)
    raise ValueError(f"unknown multi_objective_aggregation {aggregation!r}")


def _loss_mask(batch: Mapping[str, Any]) -> torch.Tensor:
    mask = batch["completion_mask"]
    return mask * batch["tool_mask"] if batch.get("tool_mask") is not None else mask


def recount_tokens(
    batch: dict[str, Any], gather: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
) -> None:
    """Set ``num_items_in_batch`` to the completion tokens left in the loss (summed over processes by
    ``gather``), as TRL counts them; the ``dapo``/``bnpo``/``cispo`` losses divide by it."""
    batch[RECOUNTED] = gather(_loss_mask(batch).sum()).sum()


def drop_rows(batch: dict[str, Any], keep: torch.Tensor) -> dict[str, Any]:
    """Mask the completions of rows where ``keep`` is False out of the loss (in place; returns ``batch``).

    The count TRL normalises by is left to :func:`recount_tokens`.
    """
    batch["completion_mask"] = batch["completion_mask"] * keep.to(batch["completion_mask"]).unsqueeze(1)
    return batch


def _pad_width(tensor: torch.Tensor, width: int, value: float, left: bool) -> torch.Tensor:
    missing = width - tensor.shape[1]
    if missing <= 0:
        return tensor
    return F.pad(tensor, (missing, 0) if left else (0, missing), value=value)


def take_rows(
    batches: Sequence[Mapping[str, Any]], picks: Sequence[tuple[int, int]], pad_id: int
) -> dict[str, Any]:
    """A batch made of row ``r`` of ``batches[b]`` for each ``(b, r)`` in ``picks``, in that order.

    Per-token tensors are padded to a common width first (prompts on the left, completions on the
    right, with TRL's values); ``num_items_in_batch`` must be recounted (:func:`recount_tokens`).
    Keys TRL only returns for images are refused: their rows cannot be told apart.

    >>> t = torch.tensor
    >>> a = {"prompt_ids": t([[5, 6]]), "completion_ids": t([[7]]), "advantages": t([1.0])}
    >>> b = {"prompt_ids": t([[8]]), "completion_ids": t([[9, 9]]), "advantages": t([2.0])}
    >>> out = take_rows([a, b], [(1, 0), (0, 0)], pad_id=0)
    >>> out["prompt_ids"].tolist(), out["completion_ids"].tolist(), out["advantages"].tolist()
    ([[0, 8], [5, 6]], [[9, 9], [7, 0]], [2.0, 1.0])
    """
    keys = set(batches[0])
    for batch in batches[1:]:
        if set(batch) != keys:
            raise ValueError(f"rounds returned different keys: {sorted(keys ^ set(batch))}")
    unknown = sorted(keys - set(LEFT_PADDED) - set(RIGHT_PADDED) - set(PER_ROW) - {RECOUNTED})
    if unknown:
        raise ValueError(
            f"cannot merge generation rounds with {unknown} (zero_signal: resample is text-only)"
        )
    offsets = [0]
    for batch in batches:
        offsets.append(offsets[-1] + len(batch["advantages"]))
    index = torch.tensor([offsets[b] + r for b, r in picks], dtype=torch.long)
    out: dict[str, Any] = {}
    for key in sorted(keys):
        if key == RECOUNTED:
            out[key] = batches[0][key]
            continue
        tensors = [batch[key] for batch in batches]
        if key in PER_ROW:
            joined = torch.cat(tensors)
        else:
            left = key in LEFT_PADDED
            value = (LEFT_PADDED if left else RIGHT_PADDED)[key]
            value = pad_id if value is None else value
            width = max(t.shape[1] for t in tensors)
            joined = torch.cat([_pad_width(t, width, value, left) for t in tensors])
        out[key] = joined.index_select(0, index.to(joined.device))
    return out


def gather_batch(
    batch: Mapping[str, Any],
    pad_id: int,
    widen: Callable[..., torch.Tensor],
    gather: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, Any]:
    """Every rank's rows of ``batch`` (a collective: each rank calls it with its own batch).

    Per-token tensors are first padded to the widest rank's width with TRL's values, prompts on the
    left and completions on the right (``widen``: accelerate's ``pad_across_processes``), then
    ``gather`` joins them in rank order. ``num_items_in_batch`` is kept as it is: a merge recounts it.
    """
    out: dict[str, Any] = {}
    for key in sorted(batch):  # the same order on every rank: each gather is a collective
        value = batch[key]
        if key == RECOUNTED:
            out[key] = value
            continue
        if key not in LEFT_PADDED and key not in RIGHT_PADDED and key not in PER_ROW:
            raise ValueError(f"cannot gather {key!r} across processes (zero_signal: resample is text-only)")
        if key in PER_ROW:
            out[key] = gather(value)
            continue
        left = key in LEFT_PADDED
        pad = (LEFT_PADDED if left else RIGHT_PADDED)[key]
        widened = widen(value, dim=1, pad_index=pad_id if pad is None else pad, pad_first=left)
        out[key] = gather(widened)
    return out


def round_size(missing: int, with_signal: int, generated: int, groups: int) -> int:
    """Prompts to draw for a resample round: the flat places left over the signal rate seen so far.

    >>> round_size(2, 4, 8, 8), round_size(2, 0, 8, 8), round_size(7, 1, 8, 8), round_size(1, 8, 8, 8)
    (4, 8, 8, 1)
    """
    if with_signal == 0:
        return groups
    return max(1, min(groups, math.ceil(missing * generated / with_signal)))


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Ranks:
    """The processes training a stage, as the sampler needs them (the defaults: one process).

    Each ``gather_*`` is a collective every rank calls at the same point, with its own part, and
    gets every rank's parts back joined in rank order along the first dimension.
    """

    index: int = 0
    count: int = 1
    gather: Callable[[torch.Tensor], torch.Tensor] = _same
    """A tensor's rows from every rank (accelerate's ``gather``)."""
    gather_list: Callable[[list[Any]], list[Any]] = _same
    """A list of JSON-like values from every rank (accelerate's ``gather_object``)."""
    gather_batch: Callable[[dict[str, Any]], dict[str, Any]] = _same
    """A TRL batch's rows from every rank, per-token tensors padded to a common width as TRL pads."""

    def own(self, rows: Sequence[Any]) -> list[Any]:
        """This rank's equal slice of ``rows`` (whole batches are cut this way: rank order).

        >>> Ranks(index=1, count=2).own([0, 1, 2, 3])
        [2, 3]
        """
        share = len(rows) // self.count
        return list(rows[self.index * share : (self.index + 1) * share])


@dataclass
class ZeroSignalCounts:
    """What dynamic sampling did to one generation batch."""

    groups: int
    with_signal: int
    dropped: int = 0
    resampled: int = 0
    rounds: int = 0
    generated: int = 0
    """Completions generated for the batch, resample rounds included."""
    retired: int = 0
    """Prompts retired from the pool so far in the stage (``retire_after``)."""
    replaced: int = 0
    """Groups of retired prompts swapped for fresh prompts before the batch was generated."""

    def metrics(self) -> dict[str, float]:
        """The batch's ``zero_signal/*`` metrics (:data:`METRICS`); completions per useful group
        only when some group had signal."""
        values = (
            self.with_signal / self.groups,
            float(self.dropped),
            float(self.resampled),
            float(self.rounds),
            self.generated / self.with_signal if self.with_signal else None,
            float(self.retired),
            float(self.replaced),
        )
        return {name: value for name, value in zip(METRICS, values, strict=True) if value is not None}


class FreshPrompts:
    """Rows of the training data in an endless shuffled order of their own, for resample rounds;
    prompts that joined the pool while the stage trains (:meth:`admit`) come first."""

    def __init__(self, dataset: Any, seed: int) -> None:
        if len(dataset) == 0:
            raise ValueError("zero_signal: resample needs training data to draw fresh prompts from")
        self.dataset, self.seed = dataset, seed
        self.generator = torch.Generator().manual_seed(seed)
        self.order: list[int] = []
        self.permutations = 0
        """Shuffles of the data drawn so far: with ``seed`` and ``len(order)`` they say where the order stands."""
        self.joined: list[dict[str, Any]] = []
        """Rows admitted by a pool refresh and not drawn yet, oldest first."""
        self._by_id: dict[str, int] | None = None

    def admit(self, rows: Sequence[Mapping[str, Any]]) -> None:
        """Queue ``rows`` (new to the pool) to be drawn before the shuffled order."""
        self.joined.extend(dict(row) for row in rows)

    def row(self, pid: str) -> dict[str, Any] | None:
        """The training data's row with id ``pid``, or None."""
        if self._by_id is None:
            self._by_id = {str(self.dataset[i].get("id")): i for i in range(len(self.dataset))}
        index = self._by_id.get(pid)
        return None if index is None else dict(self.dataset[index])

    def take(self, count: int, retired: Set[str] = frozenset()) -> list[dict[str, Any]]:
        """``count`` rows, joined ones first, skipping those whose ``id`` is in ``retired`` (while
        any other is left)."""
        rows = []
        for _ in range(count):
            while self.joined and str(self.joined[0].get("id")) in retired:
                self.joined.pop(0)
            if self.joined:
                rows.append(self.joined.pop(0))
                continue
            for _attempt in range(len(self.dataset)):
                if not self.order:
                    self.order = torch.randperm(len(self.dataset), generator=self.generator).tolist()
                    self.permutations += 1
                row = dict(self.dataset[self.order.pop()])
                if str(row.get("id")) not in retired:
                    break
            rows.append(row)
        return rows

    def state(self) -> dict[str, Any]:
        """Where the order stands and which admitted prompts wait (ids), as JSON values."""
        return {
            "permutations": self.permutations,
            "left": len(self.order),
            "joined": [str(row.get("id")) for row in self.joined],
        }

    def restore(self, state: Mapping[str, Any], rows_by_id: Mapping[str, Mapping[str, Any]]) -> None:
        """Go back to a :meth:`state` (read from a checkpoint: untrusted, so checked and bounded);
        ``rows_by_id`` resolves the admitted prompts' ids. Raises ValueError for a state this
        order cannot have reached."""
        permutations, left, joined = state.get("permutations"), state.get("left"), state.get("joined")
        size = len(self.dataset)
        if type(permutations) is not int or not 0 <= permutations <= _MAX_SHUFFLED_ROWS // size:
            raise ValueError(f"fresh prompts: permutations {permutations!r} out of range")
        if type(left) is not int or not 0 <= left <= (size if permutations else 0):
            raise ValueError(f"fresh prompts: left {left!r} out of range")
        if not isinstance(joined, list) or not all(
            isinstance(pid, str) and pid in rows_by_id for pid in joined
        ):
            raise ValueError("fresh prompts: joined must list ids of the stage's candidates")
        generator, order = torch.Generator().manual_seed(self.seed), []
        for _ in range(permutations):
            order = torch.randperm(size, generator=generator).tolist()
        self.generator, self.permutations, self.order = generator, permutations, order[:left]
        self.joined = [dict(rows_by_id[pid]) for pid in joined]


_MAX_SHUFFLED_ROWS = 100_000_000
"""Replaying a saved order's shuffles costs one draw per row; a state asking for more is not ours."""


Generate = Callable[[list[dict[str, Any]]], tuple[dict[str, Any], torch.Tensor]]
"""``generate(inputs) -> (TRL's batch dict, rewards per completion and function)``."""


class DynamicSampler:
    """Applies a stage's ``zero_signal`` mode (``drop`` or ``resample``) to one generation batch.

    ``signal(rewards)`` says which groups of a round have signal (:func:`group_signal` bound to the
    trainer's weights); ``fresh`` supplies resample prompts. ``generate`` returns this rank's
    batch and the rewards of every rank's rows (TRL gathers them); rank ``i``'s rows are
    ``[i * len(inputs), (i + 1) * len(inputs))`` of them (:class:`Ranks`).
    """

    def __init__(
        self,
        mode: str,
        num_generations: int,
        signal: Callable[[torch.Tensor], torch.Tensor],
        *,
        max_rounds: int = 4,
        fresh: FreshPrompts | None = None,
        pad_id: int = 0,
        retire_after: int | None = None,
    ) -> None:
        if mode not in ("drop", "resample"):
            raise ValueError(f"zero_signal mode {mode!r} is not drop or resample")
        if (mode == "resample" or retire_after is not None) and fresh is None:
            raise ValueError("zero_signal: resample and retire_after need a source of fresh prompts")
        self.mode, self.num_generations, self.signal = mode, num_generations, signal
        self.max_rounds, self.fresh, self.pad_id = max_rounds, fresh, pad_id
        self.retire_after = retire_after
        self.flat_streak: dict[str, int] = {}
        """Prompt id → its groups in a row that scored alike."""
        self.retired: list[str] = []
        """Prompts retired from the pool, in the order they left."""
        self.stand_ins: dict[str, dict[str, Any]] = {}
        """Retired prompt's id → the row trained in its place whenever it comes round."""

    def __call__(
        self, inputs: list[dict[str, Any]], generate: Generate, ranks: Ranks = Ranks()
    ) -> tuple[dict[str, Any], ZeroSignalCounts]:
        """This rank's batch for ``inputs`` (its slice of the generation batch) and what was done."""
        inputs, ids, replaced = self._swap_retired(inputs, ranks)
        if ids is None and self.retire_after is not None:
            ids = ranks.gather_list([str(row.get("id")) for row in inputs])
        batch, rewards = generate(inputs)
        signal = self.signal(rewards).tolist()
        self._note(ids or [], signal)
        if self.mode == "resample":
            batch, counts = self._resample(batch, signal, generate, ranks)
        else:
            counts = ZeroSignalCounts(len(signal), sum(signal), dropped=signal.count(False))
            counts.generated = len(signal) * self.num_generations
            batch = self._finish(batch, signal, ranks)
        counts.retired, counts.replaced = len(self.retired), replaced
        return batch, counts

    def _replace_retired(
        self, inputs: list[dict[str, Any]], ranks: Ranks = Ranks()
    ) -> tuple[list[dict[str, Any]], int]:
        """``inputs`` (this rank's slice of the batch) with each retired prompt's group swapped for
        its stand-in's, and how many groups of the whole batch were."""
        out, _, replaced = self._swap_retired(inputs, ranks)
        return out, replaced

    def _swap_retired(
        self, inputs: list[dict[str, Any]], ranks: Ranks
    ) -> tuple[list[dict[str, Any]], list[str] | None, int]:
        """:meth:`_replace_retired`, plus the whole batch's prompt ids after the swap (None when
        nothing is retired: then no ids were gathered). The stand-ins are chosen over the whole
        batch in order, so every rank draws the same fresh prompts for the same groups."""
        if not self.retired:
            return inputs, None, 0
        assert self.fresh is not None
        ids = ranks.gather_list([str(row.get("id")) for row in inputs])
        if len(ids) != ranks.count * len(inputs):
            raise ValueError(f"the ranks hold unequal slices of the batch ({len(ids)} rows in all)")
        retired, G = set(self.retired), self.num_generations
        first = ranks.index * len(inputs)
        out, replaced = list(inputs), 0
        for start in range(0, len(ids), G):
            pid = ids[start]
            if pid not in retired:
                continue
            stand_in = self.stand_ins.get(pid)
            if stand_in is None or str(stand_in.get("id")) in retired:
                stand_in = self.stand_ins[pid] = self.fresh.take(1, retired)[0]
            ids[start : start + G] = [str(stand_in.get("id"))] * G
            for row in range(max(start, first), min(start + G, first + len(out))):
                out[row - first] = dict(stand_in)
            replaced += 1
        return out, ids, replaced

    def _note(self, ids: list[str], signal: list[bool]) -> None:
        """Count each group (``ids``: the whole batch's rows) towards its prompt's run of flat
        groups; retire a prompt whose run reaches ``retire_after``."""
        if self.retire_after is None:
            return
        for group, has_signal in enumerate(signal):
            pid = ids[group * self.num_generations]
            if has_signal:
                self.flat_streak[pid] = 0
                continue
            self.flat_streak[pid] = self.flat_streak.get(pid, 0) + 1
            if self.flat_streak[pid] >= self.retire_after:
                self.retire(pid, f"{self.flat_streak[pid]} groups in a row scored alike")

    def state(self) -> dict[str, Any]:
        """What the sampler has decided so far, as JSON values (:mod:`posttrain.training.pool_state`)."""
        return {
            "retired": list(self.retired),
            "flat_streak": dict(self.flat_streak),
            "stand_ins": [[pid, str(row.get("id"))] for pid, row in self.stand_ins.items()],
            "fresh": self.fresh.state() if self.fresh is not None else None,
        }

    def restore(self, state: Mapping[str, Any], rows_by_id: Mapping[str, Mapping[str, Any]]) -> None:
        """Go back to a :meth:`state` read from a checkpoint (checked; ValueError if malformed)."""
        retired, streak, fresh = state.get("retired"), state.get("flat_streak"), state.get("fresh")
        pairs = state.get("stand_ins")
        if not isinstance(retired, list) or not all(isinstance(pid, str) for pid in retired):
            raise ValueError("sampler: retired must be a list of ids")
        if not isinstance(streak, dict) or not all(type(n) is int and n >= 0 for n in streak.values()):
            raise ValueError("sampler: flat_streak must map ids to counts")
        if (fresh is None) != (self.fresh is None) or (fresh is not None and not isinstance(fresh, dict)):
            raise ValueError("sampler: fresh does not match this stage's source of fresh prompts")
        if not isinstance(pairs, list) or not all(
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(pid, str) for pid in pair)
            for pair in pairs
        ):
            raise ValueError("sampler: stand_ins must pair retired ids with ids")
        stand_ins = {}
        for pid, other in pairs:
            row = rows_by_id.get(other) or (self.fresh.row(other) if self.fresh is not None else None)
            if pid not in retired or row is None:
                raise ValueError(
                    f"sampler: stand-in {other!r} of {pid!r} is not a retired prompt's known row"
                )
            stand_ins[pid] = dict(row)
        if self.fresh is not None:
            self.fresh.restore(fresh, rows_by_id)
        self.retired, self.flat_streak = list(dict.fromkeys(retired)), dict(streak)
        self.stand_ins = stand_ins

    def retire(self, pid: str, why: str) -> bool:
        """Take prompt ``pid`` out of the stage (``why`` goes in the log); False if it already was."""
        if pid in self.retired:
            return False
        self.retired.append(pid)
        logger.info("retired prompt %s: %s (%d retired)", pid, why, len(self.retired))
        return True

    def _resample(
        self, batch: dict[str, Any], signal: list[bool], generate: Generate, ranks: Ranks
    ) -> tuple[dict[str, Any], ZeroSignalCounts]:
        G = self.num_generations
        batches = [batch]
        slots = [(0, group) for group in range(len(signal))]  # (round, group) trained in each place
        filled = list(signal)
        counts = ZeroSignalCounts(len(signal), sum(signal))
        generated, with_signal = len(signal), sum(signal)
        while not all(filled) and counts.rounds < self.max_rounds:
            counts.rounds += 1
            assert self.fresh is not None
            size = round_size(filled.count(False), with_signal, generated, len(signal))
            while size * G % ranks.count:  # every rank generates an equal slice of the round
                size += 1
            prompts = [dict(row) for row in self.fresh.take(size, set(self.retired)) for _ in range(G)]
            extra, rewards = generate(ranks.own(prompts))
            fresh_signal = self.signal(rewards).tolist()
            self._note([str(row.get("id")) for row in prompts], fresh_signal)
            generated, with_signal = generated + len(fresh_signal), with_signal + sum(fresh_signal)
            batches.append(extra)
            donors = [group for group, ok in enumerate(fresh_signal) if ok]
            for place in [p for p, ok in enumerate(filled) if not ok][: len(donors)]:
                slots[place] = (len(batches) - 1, donors.pop(0))
                filled[place] = True
                counts.resampled += 1
        if len(batches) > 1:
            # A place's donor may have been generated on another rank: merge the whole batch
            # (every rank's rows of every round) and keep this rank's slice of it.
            picks = ranks.own([(b, group * G + j) for b, group in slots for j in range(G)])
            everything = [ranks.gather_batch(part) for part in batches] if ranks.count > 1 else batches
            batch = take_rows(everything, picks, self.pad_id)
        counts.with_signal = sum(filled)
        counts.dropped = filled.count(False)
        counts.generated = generated * G
        return self._finish(batch, filled, ranks), counts

    def _finish(self, batch: dict[str, Any], groups_kept: list[bool], ranks: Ranks) -> dict[str, Any]:
        """Mask this rank's rows of the groups not kept (``groups_kept``: the whole batch's) out of
        the loss and recount its tokens over every rank."""
        rows_kept = [kept for kept in groups_kept for _ in range(self.num_generations)]
        drop_rows(batch, torch.tensor(ranks.own(rows_kept), dtype=torch.bool))
        recount_tokens(batch, ranks.gather)
        return batch
