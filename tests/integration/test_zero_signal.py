"""Dynamic sampling (a GRPO stage's `zero_signal`): which groups have signal, drop, resample, and a real stage.

The pure tests drive `DynamicSampler` with a fake `generate` whose batches look like TRL's (ragged widths,
so merging must re-pad) and whose rewards pay only some prompts; the stage tests run the tiny model
through TRL's own generation and posttrain's bf16 shadow rollout.
"""

from __future__ import annotations

import pytest
import torch
from thread_world import ThreadWorld

from posttrain.core.config import DataConfig, GRPOStageConfig, ModelConfig, SyntheticConfig
from posttrain.training.zero_signal import (
    METRICS,
    ZERO_STD,
    DynamicSampler,
    FreshPrompts,
    Ranks,
    ZeroSignalCounts,
    gather_batch,
    group_signal,
    recount_tokens,
    round_size,
    take_rows,
)

G = 4
PAD = 0
NAN = float("nan")


def rewards_of(*groups):
    return torch.tensor([[v] for g in groups for v in g])


SIGNAL_CASES = [
    # (name, rewards per function, weights, aggregation, expected per group)
    ("all equal / mixed", rewards_of([1, 1, 1, 1], [0, 1, 0, 0]), [1.0], "sum_then_normalize", [False, True]),
    ("all zero", rewards_of([0, 0, 0, 0]), [1.0], "sum_then_normalize", [False]),
    (
        "tiny fp difference is no signal",
        rewards_of([0.5, 0.5, 0.5, 0.5 + 1e-9]),
        [1.0],
        "sum_then_normalize",
        [False],
    ),
    ("one scorable completion", rewards_of([NAN, NAN, NAN, 1.0]), [1.0], "sum_then_normalize", [False]),
    ("unscorable rows left out", rewards_of([NAN, 1.0, 0.0, 1.0]), [1.0], "sum_then_normalize", [True]),
    (
        "weight 0 silences a reward",
        torch.tensor([[1.0, 0.5], [0.0, 0.5], [1.0, 0.5], [0.0, 0.5]]),
        [0.0, 1.0],
        "sum_then_normalize",
        [False],
    ),
    (
        "rewards that cancel in the sum",
        torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]),
        [1.0, 1.0],
        "sum_then_normalize",
        [False],
    ),
    (
        "... differ per reward when normalised first",
        torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]]),
        [1.0, 1.0],
        "normalize_then_sum",
        [True],
    ),
    (
        "normalised first: each reward constant within the group, though they differ from each other",
        torch.tensor([[1.0, 0.0]] * 4 + [[1.0, 0.0], [1.0, 1.0], [1.0, 0.0], [1.0, 0.0]]),
        [1.0, 1.0],
        "normalize_then_sum",
        [False, True],
    ),
    # a weight scales the differences, so a tiny one puts them under the noise floor
    ("tiny weight", rewards_of([0, 1, 0, 1]), [1e-9], "sum_then_normalize", [False]),
    ("tiny weight, normalised first", rewards_of([0, 1, 0, 1]), [1e-9], "normalize_then_sum", [False]),
    # the threshold: sample std (Bessel, n - 1) strictly above ZERO_STD. [0, 0, 0, x] has std x/2 (x*0.43
    # without Bessel's correction); [nan, nan, 0, x] has std x/sqrt(2) over its two scored completions
    ("std 1.05e-8 (x = 2.1e-8)", rewards_of([0, 0, 0, 2.1e-8]), [1.0], "sum_then_normalize", [True]),
    ("std 0.95e-8 (x = 1.9e-8)", rewards_of([0, 0, 0, 1.9e-8]), [1.0], "sum_then_normalize", [False]),
    ("two scored, std 1.06e-8", rewards_of([NAN, NAN, 0, 1.5e-8]), [1.0], "sum_then_normalize", [True]),
    ("two scored, std 0.92e-8", rewards_of([NAN, NAN, 0, 1.3e-8]), [1.0], "sum_then_normalize", [False]),
    ("std 1.05e-8, normalised first", rewards_of([0, 0, 0, 2.1e-8]), [1.0], "normalize_then_sum", [True]),
    ("std 0.95e-8, normalised first", rewards_of([0, 0, 0, 1.9e-8]), [1.0], "normalize_then_sum", [False]),
    ("two scored, normalised first", rewards_of([NAN, NAN, 0, 1.5e-8]), [1.0], "normalize_then_sum", [True]),
    # exactly at the threshold: float32 std of [0, 0, 0, 2e-8] is float32(1e-8) itself
    ("std == ZERO_STD is no signal", rewards_of([0, 0, 0, 2e-8]), [1.0], "sum_then_normalize", [False]),
    ("std == ZERO_STD, normalised first", rewards_of([0, 0, 0, 2e-8]), [1.0], "normalize_then_sum", [False]),
]


@pytest.mark.parametrize(
    "rewards, weights, aggregation, expected", [c[1:] for c in SIGNAL_CASES], ids=[c[0] for c in SIGNAL_CASES]
)
def test_group_signal(rewards, weights, aggregation, expected):
    assert group_signal(rewards, weights, G, aggregation).tolist() == expected


def test_group_signal_refuses_rows_that_do_not_form_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        group_signal(torch.zeros(6, 1), [1.0], G)


def test_group_signal_at_zero_std_agrees_with_trls_frac_reward_zero_std():
    """TRL counts a group as flat when `torch.isclose(std, 0)` (atol 1e-8, inclusive); a group exactly at
    ZERO_STD must be flat for both, or the no-signal alert and dynamic sampling would disagree on it."""
    rewards = rewards_of([0, 0, 0, 2e-8], [0, 0, 0, 2.1e-8])
    std = rewards.view(-1, G).std(dim=1)
    assert std[0] == torch.tensor(ZERO_STD)  # the case really sits on the threshold
    flat_for_trl = torch.isclose(std, torch.zeros_like(std))
    assert group_signal(rewards, [1.0], G).tolist() == (~flat_for_trl).tolist() == [False, True]


def test_group_signal_refuses_an_unknown_aggregation_by_name():
    with pytest.raises(ValueError, match=r"^unknown multi_objective_aggregation 'mean'$"):
        group_signal(rewards_of([0, 1, 0, 1]), [1.0], G, "mean")


def test_recount_tokens_counts_only_tokens_in_the_loss():
    """A tool call's tokens (tool_mask 0) are not trained on, as TRL leaves them out of its count."""
    batch = {
        "completion_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]),
        "tool_mask": torch.tensor([[1, 0, 1, 1], [0, 1, 1, 1]]),
    }
    recount_tokens(batch)
    assert int(batch["num_items_in_batch"]) == 3
    batch["tool_mask"] = None  # TRL's batch without tools
    recount_tokens(batch)
    assert int(batch["num_items_in_batch"]) == 5
    del batch["tool_mask"]
    recount_tokens(batch, gather=lambda t: torch.stack([t, torch.tensor(7)]))  # another process has 7
    assert int(batch["num_items_in_batch"]) == 12


@pytest.mark.parametrize(
    "missing, with_signal, generated, groups, expected",
    [
        (2, 4, 8, 8, 4),  # half had signal: twice the places left
        (2, 0, 8, 8, 8),  # none had signal yet: a whole batch
        (7, 1, 8, 8, 8),  # never more than a batch
        (1, 8, 8, 8, 1),  # every group had signal: one prompt per place
        (1, 3, 4, 4, 2),  # ceil(4 / 3)
        (3, 5, 12, 16, 8),  # ceil(36 / 5)
    ],
)
def test_round_size(missing, with_signal, generated, groups, expected):
    assert round_size(missing, with_signal, generated, groups) == expected


def test_metrics_name_each_count():
    counts = ZeroSignalCounts(
        groups=8, with_signal=6, dropped=2, resampled=3, rounds=4, generated=48, retired=5, replaced=1
    )
    assert counts.metrics() == {
        "zero_signal/frac_signal": 0.75,
        "zero_signal/groups_dropped": 2.0,
        "zero_signal/groups_resampled": 3.0,
        "zero_signal/rounds": 4.0,
        "zero_signal/completions_per_useful_group": 8.0,
        "zero_signal/prompts_retired": 5.0,
        "zero_signal/groups_replaced": 1.0,
    }
    # a batch without a useful group has no cost per useful group (not a division by zero)
    assert "zero_signal/completions_per_useful_group" not in ZeroSignalCounts(4, 0, generated=16).metrics()


def signal_metrics(counts):
    """The four counts of what happened to the batch's groups (the rest: cost and retirement)."""
    return {k: v for k, v in counts.metrics().items() if k in METRICS[:4]}


# --------------------------------------------------------------------------- a fake TRL


def tagged_batch(inputs, p_width: int, c_width: int, lengths: list[int]) -> dict:
    """A TRL-shaped batch of `inputs` whose every tensor holds the row's prompt id (so a merge that
    mixes rows shows), with completions of `lengths` tokens."""
    ids = torch.tensor([row["id"] for row in inputs])
    completion_mask = (torch.arange(c_width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {
        "prompt_ids": ids[:, None].repeat(1, p_width),
        "prompt_mask": torch.ones(len(inputs), p_width, dtype=torch.long),
        "completion_ids": ids[:, None].repeat(1, c_width) * completion_mask,
        "completion_mask": completion_mask,
        "advantages": ids.float(),
        "old_per_token_logps": ids[:, None].float().repeat(1, c_width),
        "num_items_in_batch": completion_mask.sum(),
    }


def fake_generate(rounds: list):
    """TRL's batch for `inputs` (rows tagged with the prompt id in every tensor) and the rewards: a prompt
    whose `pays` is true scores 0,1,0,1 across its group, any other 0. Each call's widths differ."""

    def generate(inputs):
        n = len(inputs)
        call = len(rounds)
        rounds.append([row["id"] for row in inputs[::G]])
        p_width, c_width = 2 + call, 3 + 2 * call
        batch = tagged_batch(inputs, p_width, c_width, [1 + (i % c_width) for i in range(n)])
        rewards = torch.tensor(
            [[1.0 if row.get("solved") else float(row["pays"] and i % 2)] for i, row in enumerate(inputs)]
        )
        return batch, rewards

    return generate


def prompts(ids, paying):
    return [{"id": i, "pays": i in paying} for i in ids for _ in range(G)]


def sampler(mode, fresh_rows=(), max_rounds=4, retire_after=None):
    fresh = FreshPrompts([{"id": i, "pays": pays} for i, pays in fresh_rows], seed=0) if fresh_rows else None
    signal = lambda rewards: group_signal(rewards, [1.0], G)  # noqa: E731
    return DynamicSampler(
        mode, G, signal, max_rounds=max_rounds, fresh=fresh, pad_id=PAD, retire_after=retire_after
    )


def trained_groups(batch):
    """Prompt id of each group whose completions stay in the loss."""
    kept = batch["completion_mask"].view(-1, G, batch["completion_mask"].shape[1]).sum((1, 2)) > 0
    ids = batch["advantages"].view(-1, G)[:, 0].long()
    return [int(i) for i, k in zip(ids, kept, strict=True) if k]


def check_rows_consistent(batch):
    """Every tensor of a row still belongs to the same prompt (tagged by id), so the merge kept rows whole."""
    ids = batch["advantages"].long()
    for key in ("prompt_ids", "completion_ids", "old_per_token_logps"):
        tensor = batch[key].long()
        for row, i in enumerate(ids.tolist()):
            values = set(tensor[row].tolist()) - {PAD}
            assert values <= {i}, f"{key} row {row} mixes prompts: {values} vs {i}"
    masked = batch["completion_mask"].bool()
    assert (batch["completion_ids"][masked] == ids[:, None].expand_as(masked)[masked]).all()
    assert int(batch["num_items_in_batch"]) == int(batch["completion_mask"].sum())


def test_drop_masks_constant_groups_out_of_the_loss():
    rounds: list = []
    batch, counts = sampler("drop")(prompts([1, 2, 3], paying={2}), fake_generate(rounds))
    assert trained_groups(batch) == [2]
    assert signal_metrics(counts) == dict(zip(METRICS[:4], (1 / 3, 2.0, 0.0, 0.0), strict=True))
    assert len(rounds) == 1  # drop never generates again
    check_rows_consistent(batch)


@pytest.mark.parametrize("mode", ["drop", "resample"])
def test_a_prompt_the_policy_always_solves_retires_and_is_not_generated_again(mode):
    """Prompt 1 is always solved (its group scores 1,1,1,1: no signal): after two such groups in a
    row it leaves, and the next batch that holds it generates a fresh prompt in its place."""
    rounds: list = []
    generate = fake_generate(rounds)
    run = sampler(mode, fresh_rows=[(7, True), (8, True)], retire_after=2)
    solved = {"id": 1, "pays": False, "solved": True}
    batch_rows = [dict(solved) for _ in range(G)] + prompts([2], paying={2})
    for _ in range(2):
        _, counts = run(batch_rows, generate)
    assert run.retired == ["1"] and counts.retired == 1 and counts.replaced == 0
    before = len(rounds)
    batch, counts = run(batch_rows, generate)
    assert rounds[before][0] in (7, 8) and 1 not in [i for r in rounds[before:] for i in r]
    assert counts.replaced == 1 and trained_groups(batch) == [rounds[before][0], 2]  # both pay
    assert counts.metrics()["zero_signal/groups_replaced"] == 1.0
    # the stand-in stays: the next time prompt 1 comes round, the same fresh prompt trains in its place
    stand_in = rounds[before][0]
    for _ in range(3):
        run(batch_rows, generate)
        assert rounds[-1][0] == stand_in
    run.retire(str(stand_in), "a stand-in can leave too")  # then prompt 1 gets the other fresh prompt
    run(batch_rows, generate)
    assert rounds[-1][0] == ({7, 8} - {stand_in}).pop()


def test_a_prompt_with_signal_in_between_keeps_its_place():
    rounds: list = []
    run = sampler("drop", fresh_rows=[(7, True)], retire_after=2)
    flat, paying = prompts([1], paying=set()), prompts([1], paying={1})
    for rows in (flat, paying, flat):  # never two flat groups in a row
        run(rows, fake_generate(rounds))
    assert run.retired == [] and rounds == [[1], [1], [1]]


def test_drop_with_nothing_to_learn_leaves_an_empty_loss():
    batch, counts = sampler("drop")(prompts([1, 2], paying=set()), fake_generate([]))
    assert trained_groups(batch) == [] and int(batch["num_items_in_batch"]) == 0
    assert counts.dropped == 2 and counts.with_signal == 0


def test_drop_keeps_the_rows_of_this_process_only():
    """Signal is decided on every process's rewards; each process masks its own slice of the rows."""

    def two_process_generate(inputs):
        batch, _ = fake_generate([])(inputs)
        everyone = inputs + prompts([9], paying={9})  # the other process's group pays
        return batch, fake_generate([])(everyone)[1]

    other = Ranks(index=0, count=2, gather_list=lambda ids: ids + ["9"] * G)
    batch, counts = sampler("drop")(prompts([1], paying=set()), two_process_generate, other)
    assert trained_groups(batch) == [] and counts.groups == 2 and counts.with_signal == 1


def test_resample_refills_flat_groups_with_fresh_groups_that_have_signal():
    rounds: list = []
    fresh = [(10, False), (11, True), (12, False), (13, True), (14, True), (15, False)]
    batch, counts = sampler("resample", fresh)(prompts([1, 2, 3, 4], paying={3}), fake_generate(rounds))
    groups = trained_groups(batch)
    assert len(batch["advantages"]) == 4 * G  # the batch keeps its size
    assert groups[2] == 3 and set(groups[:2] + groups[3:]) <= {11, 13, 14}  # the paying group stays put
    assert signal_metrics(counts) == dict(
        zip(METRICS[:4], (1.0, 0.0, 3.0, float(len(rounds) - 1)), strict=True)
    )
    assert 1 <= counts.rounds <= 4
    check_rows_consistent(batch)


def test_resample_falls_back_to_drop_when_the_budget_runs_out():
    rounds: list = []
    fresh = [(10, False), (11, False), (12, True)]
    batch, counts = sampler("resample", fresh, max_rounds=1)(
        prompts([1, 2, 3], paying=set()), fake_generate(rounds)
    )
    assert (
        counts.rounds == 1 and len(rounds) == 2 and sorted(rounds[1]) == [10, 11, 12]
    )  # none had signal yet
    assert trained_groups(batch) == [12]
    assert signal_metrics(counts) == dict(zip(METRICS[:4], (1 / 3, 2.0, 1.0, 1.0), strict=True))
    check_rows_consistent(batch)


def test_resample_stops_generating_once_the_batch_is_full():
    rounds: list = []
    batch, counts = sampler("resample", [(10, True)])(prompts([1, 2], paying={1, 2}), fake_generate(rounds))
    assert len(rounds) == 1 and counts.rounds == 0 and trained_groups(batch) == [1, 2]


def test_resample_round_size_follows_the_signal_rate():
    """3 of 4 groups had signal: the one flat place needs ceil(4/3) = 2 fresh prompts, not a whole batch."""
    rounds: list = []
    fresh = [(10 + i, True) for i in range(8)]
    sampler("resample", fresh)(prompts([1, 2, 3, 4], paying={1, 2, 3}), fake_generate(rounds))
    assert [len(r) for r in rounds] == [4, 2]


def test_resample_default_budget_is_four_rounds_then_drop():
    rounds: list = []
    generate = fake_generate(rounds)

    def bounded(inputs):
        assert len(rounds) < 6, "the round budget is not enforced"
        return generate(inputs)

    signal = lambda rewards: group_signal(rewards, [1.0], G)  # noqa: E731
    fresh = FreshPrompts([{"id": 10 + i, "pays": False} for i in range(3)], seed=0)
    batch, counts = DynamicSampler("resample", G, signal, fresh=fresh)(prompts([1, 2], paying=set()), bounded)
    assert len(rounds) == 5 and counts.rounds == 4
    assert signal_metrics(counts) == dict(zip(METRICS[:4], (0.0, 2.0, 0.0, 4.0), strict=True))
    assert trained_groups(batch) == [] and int(batch["num_items_in_batch"]) == 0


class ListedPrompts:
    """Fresh prompts in a fixed order (FreshPrompts shuffles), to steer which round finds what."""

    def __init__(self, rows):
        self.rows = list(rows)

    def take(self, count, retired=frozenset()):
        taken, self.rows = self.rows[:count], self.rows[count:]
        return [{"id": i, "pays": pays} for i, pays in taken]


def test_resample_round_sizes_follow_the_signal_rate_of_every_round_so_far():
    """2 of 4 groups pay: 2 places over rate 2/4 -> 4 prompts; 1 of those pays: 1 place over 3/8 -> 3."""
    rounds: list = []
    fresh = ListedPrompts([(10, False), (11, True), (12, False), (13, False), (14, False), (15, False)] * 2)
    signal = lambda rewards: group_signal(rewards, [1.0], G)  # noqa: E731
    batch, counts = DynamicSampler("resample", G, signal, max_rounds=2, fresh=fresh)(
        prompts([1, 2, 3, 4], paying={1, 3}), fake_generate(rounds)
    )
    assert [len(r) for r in rounds] == [4, 4, 3]
    assert trained_groups(batch) == [1, 11, 3] and counts.resampled == 1 and counts.dropped == 1
    check_rows_consistent(batch)


def test_resample_pads_merged_rounds_with_the_pad_id():
    """Each round is wider than the last (fake_generate): the first round's rows are padded to the widest,
    prompts on the left with the tokenizer's pad id, completions on the right."""
    for pad_id, sampler_kwargs in ((0, {}), (7, {"pad_id": 7})):  # 0 is the default
        rounds: list = []
        signal = lambda rewards: group_signal(rewards, [1.0], G)  # noqa: E731
        fresh = ListedPrompts([(11, True)])
        batch, _ = DynamicSampler("resample", G, signal, fresh=fresh, **sampler_kwargs)(
            prompts([1, 2], paying={1}), fake_generate(rounds)
        )
        assert len(rounds) == 2 and trained_groups(batch) == [1, 11]
        assert batch["prompt_ids"][0].tolist() == [pad_id, 1, 1]  # round 0: width 2 of 3
        assert batch["prompt_mask"][0].tolist() == [0, 1, 1]
        # round 0 is 3 wide (fake_generate writes 0 past a completion's end), padded to 5
        assert batch["completion_ids"][0].tolist() == [1, 0, 0, pad_id, pad_id]
        assert batch["prompt_ids"][G].tolist() == [11, 11, 11]  # round 1 as generated
        assert batch["old_per_token_logps"][0].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_resample_leaves_a_batch_with_signal_everywhere_as_generated():
    """No round, no merge: even keys a merge would refuse (images) pass."""
    extra = torch.arange(2 * G * 3).view(2 * G, 3)

    def generate(inputs):
        batch, rewards = fake_generate([])(inputs)
        batch["pixel_values"] = extra
        return batch, rewards

    batch, counts = sampler("resample", [(10, True)])(prompts([1, 2], paying={1, 2}), generate)
    assert counts.rounds == 0 and batch["pixel_values"] is extra


def test_drop_sums_the_token_count_over_processes():
    """The loss divides by every process's tokens: `gather` collects them."""
    gathered = []

    def gather(t):
        gathered.append(int(t))
        return torch.stack([t, torch.tensor(100)])  # another process kept 100 tokens

    batch, _ = sampler("drop")(prompts([1, 2], paying={2}), fake_generate([]), Ranks(gather=gather))
    assert gathered == [int(batch["completion_mask"].sum())] and gathered[0] > 0
    assert int(batch["num_items_in_batch"]) == gathered[0] + 100


def test_drop_masks_the_slice_of_a_later_process():
    def two_process_generate(inputs):
        batch, _ = fake_generate([])(inputs)
        everyone = prompts([8, 9], paying={8}) + inputs  # this is process 1: its rows come second
        return batch, fake_generate([])(everyone)[1]

    first = Ranks(index=1, count=2, gather_list=lambda ids: ["8"] * G + ["9"] * G + ids)
    batch, counts = sampler("drop")(prompts([1, 2], paying={2}), two_process_generate, first)
    assert trained_groups(batch) == [2] and counts.groups == 4 and counts.with_signal == 2


def test_sampler_refuses_a_mode_it_does_not_know_and_resample_without_fresh_prompts():
    signal = lambda rewards: group_signal(rewards, [1.0], G)  # noqa: E731
    with pytest.raises(ValueError, match=r"^zero_signal mode 'keep' is not drop or resample$"):
        DynamicSampler("keep", G, signal)
    with pytest.raises(ValueError, match=r"^zero_signal: resample and retire_after need a source of fresh"):
        DynamicSampler("resample", G, signal)
    with pytest.raises(ValueError, match=r"^zero_signal: resample and retire_after need a source of fresh"):
        DynamicSampler("drop", G, signal, retire_after=3)
    with pytest.raises(
        ValueError, match=r"^zero_signal: resample needs training data to draw fresh prompts from$"
    ):
        FreshPrompts([], seed=0)


def _round(width_p, width_c, ids, *, tool=False):
    n = len(ids)
    t = torch.tensor(ids)
    batch = {
        "prompt_ids": t[:, None].repeat(1, width_p),
        "prompt_mask": torch.ones(n, width_p, dtype=torch.long),
        "completion_ids": t[:, None].repeat(1, width_c),
        "completion_mask": torch.ones(n, width_c, dtype=torch.long),
        "advantages": t.float(),
        "importance_sampling_ratio": torch.full((n, width_c), 0.5),
        "num_items_in_batch": torch.tensor(n * width_c),
    }
    if tool:
        batch["tool_mask"] = torch.zeros(n, width_c, dtype=torch.long)
    return batch


def test_take_rows_pads_each_tensor_with_its_own_value_and_side():
    """Rows from three rounds of different widths, in the order picked; pad id 9."""
    a, b, c = _round(1, 2, [1, 2], tool=True), _round(3, 1, [3, 4], tool=True), _round(2, 3, [5], tool=True)
    out = take_rows([a, b, c], [(2, 0), (0, 1), (1, 0)], pad_id=9)
    assert out["advantages"].tolist() == [5.0, 2.0, 3.0]
    assert out["prompt_ids"].tolist() == [[9, 5, 5], [9, 9, 2], [3, 3, 3]]
    assert out["prompt_mask"].tolist() == [[0, 1, 1], [0, 0, 1], [1, 1, 1]]
    assert out["completion_ids"].tolist() == [[5, 5, 5], [2, 2, 9], [3, 9, 9]]
    assert out["completion_mask"].tolist() == [[1, 1, 1], [1, 1, 0], [1, 0, 0]]
    assert out["tool_mask"].tolist() == [[0, 0, 0], [0, 0, 1], [0, 1, 1]]  # padding is not a tool call
    assert out["importance_sampling_ratio"].tolist() == [[0.5] * 3, [0.5, 0.5, 1.0], [0.5, 1.0, 1.0]]


@pytest.mark.parametrize(
    "odd", [0, 1, 2], ids=["first-round-differs", "second-round-differs", "third-round-differs"]
)
def test_take_rows_refuses_rounds_with_different_keys(odd):
    batches = [_round(1, 1, [1]), _round(1, 1, [2]), _round(1, 1, [3])]
    batches[odd]["tool_mask"] = torch.ones(1, 1)
    with pytest.raises(ValueError, match=r"^rounds returned different keys: \['tool_mask'\]$"):
        take_rows(batches, [(0, 0)], PAD)
    with pytest.raises(ValueError, match=r"^rounds returned different keys: \['tool_mask'\]$"):
        take_rows([batches[odd], batches[(odd + 1) % 3]], [(0, 0)], PAD)


def test_take_rows_refuses_what_it_cannot_merge():
    batch = {"advantages": torch.zeros(1), "pixel_values": torch.zeros(1, 3)}
    with pytest.raises(ValueError, match="pixel_values"):
        take_rows([batch, batch], [(0, 0)], PAD)


def test_fresh_prompts_cover_the_data_before_repeating():
    fresh = FreshPrompts([{"id": i} for i in range(5)], seed=3)
    first, second = fresh.take(5), fresh.take(5)
    assert sorted(r["id"] for r in first) == sorted(r["id"] for r in second) == list(range(5))


def test_fresh_prompts_order_comes_from_the_seed_alone():
    """The order is the run's seed's, whatever else drew from torch's global generator in between."""
    data = [{"id": i} for i in range(12)]

    def drawn(seed, global_seed):
        fresh = FreshPrompts(data, seed=seed)
        torch.manual_seed(global_seed)
        first = fresh.take(7)
        torch.manual_seed(global_seed + 1)
        return [r["id"] for r in first + fresh.take(10)]  # past the end: a second pass

    order = drawn(3, 0)
    assert drawn(3, 1) == order
    assert sorted(order[:12]) == list(range(12)) and drawn(4, 0) != order


# --------------------------------------------------------------------------- real stages, tiny model


def pays_for_one_op(completions, ops, **kwargs):
    """0,1,0,1... across each group of a one-operation problem; 0 for every other problem."""
    return [float(op == 1 and i % 2) for i, op in enumerate(ops)]


def pays_nothing(completions, **kwargs):
    return [0.0] * len(completions)


@pytest.fixture(scope="module")
def data(tiny_tokenizer):
    from posttrain.data.prepare import prepare_data

    cfg = DataConfig(source="synthetic", synthetic=SyntheticConfig(num_examples=48, max_ops=3), eval_size=8)
    return prepare_data(cfg, tiny_tokenizer).train


def one_step_stage(tmp_path, batch: int = 16, **options):
    """A 1-step stage config of ``batch`` completions in groups of G, and its context."""
    from posttrain.training.stage_run import StageContext

    stage = GRPOStageConfig(
        name="zs",
        rewards=[{"name": "xml_count"}],
        trainer={
            "max_steps": 1,
            "per_device_train_batch_size": batch,
            "num_generations": G,
            "max_completion_length": 6,
        },
        **options,
    )
    return stage, StageContext(stage="grpo-zs", work_dir=tmp_path, seed=0, report_to="none", precision="fp32")


def train_stage(tiny_model_dir, data, tmp_path, monkeypatch, reward, fast_generation, **options):
    """A 1-step stage of 4 groups of 4 with `reward`; returns the trainer, its monitor and the batches the
    loss saw."""
    from posttrain.training import grpo

    monkeypatch.setattr(grpo, "build_reward_funcs", lambda specs: ([reward], [1.0]))
    stage, ctx = one_step_stage(tmp_path, **options)
    model_cfg = ModelConfig(name=str(tiny_model_dir), lora={"r": 4, "alpha": 8})
    trainer, monitor = grpo.make_grpo_trainer(
        stage, model_cfg, str(tiny_model_dir), data, ctx, fast_generation=fast_generation
    )
    seen = []
    scored = trainer._generate_and_score_completions

    def recorded(inputs):
        batch = scored(inputs)
        seen.append(batch)
        return batch

    trainer._generate_and_score_completions = recorded
    trainer.train()
    return trainer, monitor, seen


@pytest.mark.parametrize("shadow", [False, True], ids=["trl-generation", "shadow-rollout"])
def test_resample_stage_trains_only_on_groups_with_signal(
    tiny_model_dir, data, tmp_path, monkeypatch, shadow
):
    from posttrain.generation.rollout import ShadowRollout

    trainer, monitor, batches = train_stage(
        tiny_model_dir, data, tmp_path, monkeypatch, pays_for_one_op, shadow, zero_signal="resample"
    )
    assert isinstance(trainer.rollout_func, ShadowRollout) is shadow
    assert len(batches) == 1
    for batch in batches:
        advantages = batch["advantages"].view(-1, G)
        assert (advantages.abs().max(dim=1).values > 0.5).all()  # every group pays 0,1,0,1: signal
        assert batch["completion_mask"].view(-1, G, batch["completion_mask"].shape[1]).sum((1, 2)).gt(0).all()
    rows = [r for r in trainer.state.log_history if "zero_signal/frac_signal" in r]
    assert [r["zero_signal/frac_signal"] for r in rows] == [1.0]
    assert all(r["zero_signal/groups_resampled"] >= 1 and r["zero_signal/rounds"] >= 1 for r in rows)
    assert not [a for a in monitor.alerts if a["kind"] == "no_signal"]


def test_drop_stage_with_constant_rewards_drops_every_group_and_still_alerts(
    tiny_model_dir, data, tmp_path, monkeypatch
):
    trainer, monitor, batches = train_stage(
        tiny_model_dir, data, tmp_path, monkeypatch, pays_nothing, True, zero_signal="drop"
    )
    assert all(int(b["num_items_in_batch"]) == 0 and b["completion_mask"].sum() == 0 for b in batches)
    rows = [r for r in trainer.state.log_history if "zero_signal/groups_dropped" in r]
    assert [(r["zero_signal/groups_dropped"], r["zero_signal/frac_signal"]) for r in rows] == [(4.0, 0.0)]
    assert [a["kind"] for a in monitor.alerts] == ["no_signal"] and "zero_signal: resample" in monitor.alerts[
        0
    ]["remedy"]


# ------------------------------------------------------------- several processes, played by threads


def row_contents(batch):
    """Each row of a batch without its padding: what the loss sees of it."""
    rows = []
    for i in range(len(batch["advantages"])):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        mask = batch["completion_mask"][i].bool()
        rows.append(
            (
                float(batch["advantages"][i]),
                tuple(prompt),
                tuple(batch["completion_ids"][i][: mask.numel()][mask].tolist()),
                tuple(batch["old_per_token_logps"][i][mask].tolist()),
            )
        )
    return rows


def id_generate(rounds: list, index: int = 0):
    """fake_generate for rank `index`, with each row's lengths and rewards set by its prompt and its
    place in the group (from the row's place in the whole batch), not by its place in the slice."""

    def generate(inputs):
        rounds.append([row["id"] for row in inputs])
        n = len(inputs)
        places = [(index * n + i) % G for i in range(n)]
        p_width, c_width = 2 + len(rounds) % 2, 3 + len(rounds) % 3
        lengths = [1 + (row["id"] + j) % c_width for row, j in zip(inputs, places, strict=True)]
        batch = tagged_batch(inputs, p_width, c_width, lengths)
        rewards = torch.tensor(
            [[float(row["pays"] and j % 2)] for row, j in zip(inputs, places, strict=True)]
        )
        return batch, rewards

    return generate


def groups_of(ids, paying):
    return [{"id": i, "pays": i in paying} for i in ids for _ in range(G)]


FRESH = [(20 + i, i % 3 != 0) for i in range(12)]  # one fresh prompt in three never pays
BATCHES = [  # the whole generation batch of each step: 4 groups; prompts 1 and 3 never pay
    groups_of([1, 2, 3, 4], paying={2}),
    groups_of([3, 1, 5, 6], paying={5, 6}),
    groups_of([1, 3, 7, 8], paying={7}),  # with resample, its second round draws 3 prompts
    groups_of([2, 1, 3, 9], paying={2, 9}),
]


def one_process(mode):
    run = sampler(mode, fresh_rows=FRESH, retire_after=2)
    generate = id_generate([])
    out = []
    for rows in BATCHES:
        batch, counts = run([dict(r) for r in rows], generate)
        out.append((row_contents(batch), int(batch["num_items_in_batch"]), counts.metrics()))
    return out, run.state()


def on_ranks(mode, count):
    world = ThreadWorld(count)

    def rank(index):
        run, ranks = sampler(mode, fresh_rows=FRESH, retire_after=2), world.ranks(index, PAD)
        generate_own = id_generate([], index)

        def generate(inputs):  # TRL: this rank's batch, every rank's rewards
            batch, rewards = generate_own(inputs)
            return batch, ranks.gather(rewards)

        out = []
        for rows in BATCHES:
            batch, counts = run(ranks.own([dict(r) for r in rows]), generate, ranks)
            out.append((row_contents(batch), int(batch["num_items_in_batch"]), counts.metrics()))
        return out, run.state()

    return world.run(rank)


@pytest.mark.parametrize(
    "mode, count",
    [("drop", 2), ("resample", 2), ("drop", 8)],
    ids=["drop-groups-whole-on-a-rank", "resample-groups-whole-on-a-rank", "drop-groups-across-ranks"],
)
def test_ranks_keep_one_pool_and_together_train_the_one_process_batch(mode, count):
    """Each rank sees its slice of every batch (with 8 ranks a group of 4 spans two); they retire
    the same prompts, draw the same stand-ins and resample prompts, and their trained rows, joined
    in rank order, are the 1-process run's, with its token count and metrics."""
    expected, expected_state = one_process(mode)
    # the fixture retires prompts, swaps in stand-ins and (resample) refills flat places
    assert {"1", "3"} <= set(expected_state["retired"]) and expected_state["stand_ins"]
    if mode == "resample":
        assert [metrics["zero_signal/rounds"] for _, _, metrics in expected] == [2, 1, 1, 0]
    results = on_ranks(mode, count)
    for out, state in results:
        assert state == expected_state
        for (_, tokens, metrics), (_, want_tokens, want_metrics) in zip(out, expected, strict=True):
            assert tokens == want_tokens and metrics == want_metrics
    joined = [[row for out, _ in results for row in out[step][0]] for step in range(len(BATCHES))]
    assert joined == [rows for rows, _, _ in expected]


def test_a_round_the_ranks_cannot_share_equally_grows_and_they_still_agree():
    """The first batch's second round draws 3 prompts: 12 completions do not split over 8 ranks, so
    the round draws a fourth prompt. The ranks then go on from another fresh order than one process
    (more prompts drawn), but every rank decides alike and trains whole groups."""
    expected, expected_state = one_process("resample")
    results = on_ranks("resample", 8)
    first_out, first_state = results[0]
    assert first_state["fresh"] != expected_state["fresh"]  # one prompt more drawn than in one process
    for out, state in results[1:]:
        assert state == first_state
        assert [(tokens, metrics) for _, tokens, metrics in out] == [(t, m) for _, t, m in first_out]
    for step in range(len(BATCHES)):
        joined = [row for out, _ in results for row in out[step][0]]
        tags = [row[0] for row in joined]  # the prompt id, in every row of its group
        assert len(joined) == 4 * G and all(len(set(tags[i : i + G])) == 1 for i in range(0, len(tags), G))


def test_gathered_rows_are_padded_as_trl_pads_each_tensor():
    """Two ranks with different widths: prompts padded on the left, completions on the right, each
    with its own value (the pad id, 0 for masks, 1 for the tool mask and the ratio, 0.0 for logps);
    the token count stays each rank's own (a merge recounts it)."""
    world, pad_id = ThreadWorld(2), 9
    t = torch.tensor

    def part(tag, prompt_width, completion_width):
        return {
            "prompt_ids": torch.full((1, prompt_width), tag),
            "prompt_mask": torch.ones(1, prompt_width, dtype=torch.long),
            "completion_ids": torch.full((1, completion_width), tag),
            "completion_mask": torch.ones(1, completion_width, dtype=torch.long),
            "tool_mask": torch.zeros(1, completion_width, dtype=torch.long),
            "old_per_token_logps": torch.full((1, completion_width), -float(tag)),
            "importance_sampling_ratio": torch.full((1, completion_width), 0.5),
            "advantages": t([float(tag)]),
            "num_items_in_batch": t(10 * tag),
        }

    parts = [part(1, 2, 3), part(2, 3, 1)]

    def rank(index):
        ranks = world.ranks(index, pad_id)
        return ranks.gather_batch(parts[index])

    for index, out in enumerate(world.run(rank)):
        assert out["prompt_ids"].tolist() == [[9, 1, 1], [2, 2, 2]]
        assert out["prompt_mask"].tolist() == [[0, 1, 1], [1, 1, 1]]
        assert out["completion_ids"].tolist() == [[1, 1, 1], [2, 9, 9]]
        assert out["completion_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
        assert out["tool_mask"].tolist() == [[0, 0, 0], [0, 1, 1]]
        assert out["old_per_token_logps"].tolist() == [[-1.0, -1.0, -1.0], [-2.0, 0.0, 0.0]]
        assert out["importance_sampling_ratio"].tolist() == [[0.5, 0.5, 0.5], [0.5, 1.0, 1.0]]
        assert out["advantages"].tolist() == [1.0, 2.0]
        assert int(out["num_items_in_batch"]) == 10 * (index + 1)
    with pytest.raises(ValueError, match=r"^cannot gather 'pixel_values' across processes"):
        gather_batch({"pixel_values": t([1])}, pad_id, None, None)
