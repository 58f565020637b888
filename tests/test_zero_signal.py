"""Dynamic sampling (a GRPO stage's `zero_signal`): which groups have signal, drop, resample, and a real stage.

The pure tests drive `DynamicSampler` with a fake `generate` whose batches look like TRL's (ragged widths,
so merging must re-pad) and whose rewards pay only some prompts; the stage tests run the tiny model
through TRL's own generation and posttrain's bf16 shadow rollout.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.core.config import DataConfig, GRPOStageConfig, ModelConfig, SyntheticConfig
from posttrain.training.zero_signal import (
    METRICS,
    DynamicSampler,
    FreshPrompts,
    group_signal,
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
]


@pytest.mark.parametrize(
    "rewards, weights, aggregation, expected", [c[1:] for c in SIGNAL_CASES], ids=[c[0] for c in SIGNAL_CASES]
)
def test_group_signal(rewards, weights, aggregation, expected):
    assert group_signal(rewards, weights, G, aggregation).tolist() == expected


def test_group_signal_refuses_rows_that_do_not_form_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        group_signal(torch.zeros(6, 1), [1.0], G)


# --------------------------------------------------------------------------- a fake TRL


def fake_generate(rounds: list):
    """TRL's batch for `inputs` (rows tagged with the prompt id in every tensor) and the rewards: a prompt
    whose `pays` is true scores 0,1,0,1 across its group, any other 0. Each call's widths differ."""

    def generate(inputs):
        n = len(inputs)
        call = len(rounds)
        rounds.append([row["id"] for row in inputs[::G]])
        ids = torch.tensor([row["id"] for row in inputs])
        p_width, c_width = 2 + call, 3 + 2 * call
        lengths = torch.tensor([1 + (i % c_width) for i in range(n)])
        completion_mask = (torch.arange(c_width)[None, :] < lengths[:, None]).long()
        batch = {
            "prompt_ids": ids[:, None].repeat(1, p_width),
            "prompt_mask": torch.ones(n, p_width, dtype=torch.long),
            "completion_ids": ids[:, None].repeat(1, c_width) * completion_mask,
            "completion_mask": completion_mask,
            "advantages": ids.float(),
            "old_per_token_logps": ids[:, None].float().repeat(1, c_width),
            "num_items_in_batch": completion_mask.sum(),
        }
        rewards = torch.tensor([[float(row["pays"] and i % 2)] for i, row in enumerate(inputs)])
        return batch, rewards

    return generate


def prompts(ids, paying):
    return [{"id": i, "pays": i in paying} for i in ids for _ in range(G)]


def sampler(mode, fresh_rows=(), max_rounds=4):
    fresh = FreshPrompts([{"id": i, "pays": pays} for i, pays in fresh_rows], seed=0) if fresh_rows else None
    signal = lambda rewards: group_signal(rewards, [1.0], G)  # noqa: E731
    return DynamicSampler(mode, G, signal, max_rounds=max_rounds, fresh=fresh, pad_id=PAD)


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
    assert counts.metrics() == dict(zip(METRICS, (1 / 3, 2.0, 0.0, 0.0), strict=True))
    assert len(rounds) == 1  # drop never generates again
    check_rows_consistent(batch)


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

    batch, counts = sampler("drop")(prompts([1], paying=set()), two_process_generate, process_index=0)
    assert trained_groups(batch) == [] and counts.groups == 2 and counts.with_signal == 1


def test_resample_refills_flat_groups_with_fresh_groups_that_have_signal():
    rounds: list = []
    fresh = [(10, False), (11, True), (12, False), (13, True), (14, True), (15, False)]
    batch, counts = sampler("resample", fresh)(prompts([1, 2, 3, 4], paying={3}), fake_generate(rounds))
    groups = trained_groups(batch)
    assert len(batch["advantages"]) == 4 * G  # the batch keeps its size
    assert groups[2] == 3 and set(groups[:2] + groups[3:]) <= {11, 13, 14}  # the paying group stays put
    assert counts.metrics() == dict(zip(METRICS, (1.0, 0.0, 3.0, float(len(rounds) - 1)), strict=True))
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
    assert counts.metrics() == dict(zip(METRICS, (1 / 3, 2.0, 1.0, 1.0), strict=True))
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


def test_take_rows_refuses_what_it_cannot_merge():
    batch = {"advantages": torch.zeros(1), "pixel_values": torch.zeros(1, 3)}
    with pytest.raises(ValueError, match="pixel_values"):
        take_rows([batch, batch], [(0, 0)], PAD)


def test_fresh_prompts_cover_the_data_before_repeating():
    fresh = FreshPrompts([{"id": i} for i in range(5)], seed=3)
    first, second = fresh.take(5), fresh.take(5)
    assert sorted(r["id"] for r in first) == sorted(r["id"] for r in second) == list(range(5))


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


def train_stage(tiny_model_dir, data, tmp_path, monkeypatch, reward, fast_generation, **options):
    """A 1-step stage of 4 groups of 4 with `reward`; returns the trainer, its monitor and the batches the
    loss saw."""
    from posttrain.training import grpo
    from posttrain.training.runner import StageContext

    monkeypatch.setattr(grpo, "build_reward_funcs", lambda specs: ([reward], [1.0]))
    stage = GRPOStageConfig(
        name="zs",
        rewards=[{"name": "xml_count"}],
        trainer={
            "max_steps": 1,
            "per_device_train_batch_size": 16,
            "num_generations": G,
            "max_completion_length": 6,
        },
        **options,
    )
    ctx = StageContext(stage="grpo-zs", work_dir=tmp_path, seed=0, report_to="none", precision="fp32")
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
