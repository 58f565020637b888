"""The pool refresh of a GRPO stage with ``pass_rate.refresh_every``: prompts whose pass rate under
the policy as it is has left the band leave the stage, outside candidates inside it join.

The policy is scripted (one Llama layer whose next token depends on the current token only): after
the prompt it answers ``<answer>7</answer>`` with probability ``p``, else ``<answer>8</answer>``,
whatever the question. With ``p`` ≈ 1 a question whose gold is 7 is always solved; with ``p`` = 3/4
it is solved sometimes, and one whose gold is 9 never.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from types import SimpleNamespace

import pytest
from scripted_models import answers_seven_mostly
from thread_world import ThreadWorld

from posttrain.core.config import GRPOStageConfig, PassRateConfig
from posttrain.training.pool_refresh import METRICS, PoolRefresh
from posttrain.training.pool_state import STATE_KEY, PoolCheckpoint
from posttrain.training.zero_signal import DynamicSampler, FreshPrompts, Ranks, group_signal

K = 8
ONE_PROCESS = Ranks()
MESSAGES = [{"role": "user", "content": "Q"}]


def stage(**pass_rate):
    return GRPOStageConfig(
        name="fresh",
        rewards=[{"name": "correctness"}],
        pass_rate=PassRateConfig(samples=K, refresh_every=2, **pass_rate),
        zero_signal="drop",
        trainer={"max_completion_length": 12, "temperature": 1.0, "num_generations": 2},
    )


def rows(golds: dict[str, int]):
    return [
        {"id": pid, "question": pid, "answer": str(gold), "prompt": MESSAGES} for pid, gold in golds.items()
    ]


def policy(tokenizer, p_seven: float):
    opener = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return answers_seven_mostly(tokenizer, opener, p_seven)


def fake_trainer(model, tokenizer, fresh_rows, ranks=ONE_PROCESS, distributed_type="NO", state=None):
    """What the refresh reads of posttrain's GRPO trainer: its policy, tokenizer, dynamic sampler
    and processes."""
    sampler = DynamicSampler(
        "drop", 2, lambda r: group_signal(r, [1.0], 2), fresh=FreshPrompts(fresh_rows, seed=0)
    )
    return SimpleNamespace(
        model=model,
        processing_class=tokenizer,
        args=SimpleNamespace(chat_template_kwargs=None),
        accelerator=SimpleNamespace(unwrap_model=lambda m: m, distributed_type=distributed_type, state=state),
        _metrics={"train": defaultdict(list)},
        _posttrain_sampler=sampler,
        _posttrain_ranks=ranks,
    )


def refresher(tokenizer, p_seven, candidates, pool, trainer_kwargs=None, **pass_rate):
    data = rows(candidates)
    fresh = [r for r in data if r["id"] != "sometimes"]
    trainer = fake_trainer(policy(tokenizer, p_seven), tokenizer, fresh, **(trainer_kwargs or {}))
    return PoolRefresh(trainer, data, pool, stage(**pass_rate), seed=0, stage="grpo-fresh"), trainer


def test_the_refresh_retires_a_prompt_the_policy_always_solves(tiny_tokenizer):
    refresh, trainer = refresher(
        tiny_tokenizer, 1 - 1e-9, {"solved": 7, "hard": 9, "other": 8}, ["solved", "hard"]
    )
    record = refresh.refresh(step=2)
    # both pool prompts are out of the band now: always solved (7) and never solved (9)
    assert record["left"] == ["solved", "hard"] and record["joined"] == []
    sampler = trainer._posttrain_sampler
    assert sampler.retired == ["solved", "hard"]
    # a retired prompt's group is swapped for a fresh prompt's before the next batch is generated
    swapped, replaced = sampler._replace_retired([{"id": "solved"}] * 2)
    assert replaced == 1 and swapped[0]["id"] == swapped[1]["id"] == "other"


def test_a_candidate_the_policy_now_sometimes_solves_joins_and_is_drawn_first(tiny_tokenizer):
    refresh, trainer = refresher(
        tiny_tokenizer, 0.75, {"pool": 8, "sometimes": 7, "never": 9}, ["pool"], refresh_size=4
    )
    record = refresh.refresh(step=2)
    assert record["joined"] == ["sometimes"] and record["left"] == []
    assert record["scored"] == 3 and record["pool"] == 2
    assert trainer._posttrain_sampler.fresh.take(1)[0]["id"] == "sometimes"
    logged = {name: values[-1] for name, values in trainer._metrics["train"].items()}
    assert set(logged) == set(METRICS)
    assert (logged["pass_rate/pool"], logged["pass_rate/refresh_joined"]) == (2.0, 1.0)


@pytest.mark.parametrize("count", [2, 3])
def test_ranks_share_the_scoring_and_take_the_one_process_decisions(tiny_tokenizer, count):
    """Each rank samples its share of the k x refresh_size completions (3 ranks: unequal shares,
    a prompt's k completions split between ranks) with the seeds they have in one process; the
    gathered scores give every rank the 1-process pass rates, so all leave and admit alike."""
    pool = ["p3", "p0", "p1", "p2"]  # the refresh scores the first three
    candidates = {**dict.fromkeys(pool, 7), "p3": 9, "c0": 7, "c1": 9, "c2": 7}  # p3 is never solved

    def refresh_on(ranks=ONE_PROCESS):
        refresh, trainer = refresher(
            tiny_tokenizer, 0.5, candidates, pool, trainer_kwargs={"ranks": ranks}, refresh_size=6
        )
        counts = refresh.score(rows(candidates), step=2)
        refresh.refresh(step=2)
        state = refresh.state()
        for record in state["history"]:
            del record["seconds"]
        sampler = trainer._posttrain_sampler
        return counts, state, sampler.retired, [row["id"] for row in sampler.fresh.joined]

    one = refresh_on()
    assert 0 < sum(one[0].values()) < K * len(candidates)  # pass rates that depend on the seeds
    assert one[2] and one[3]  # prompts left and joined
    world = ThreadWorld(count)
    assert world.run(lambda index: refresh_on(world.ranks(index))) == [one] * count


@pytest.mark.parametrize(
    "distributed_type, zero_stage, refused",
    [("FSDP", None, "fsdp"), ("DEEPSPEED", 3, "zero3"), ("DEEPSPEED", 2, None), ("MULTI_GPU", None, None)],
)
def test_a_refresh_refuses_a_policy_the_processes_shard(
    tiny_tokenizer, distributed_type, zero_stage, refused
):
    """Checked as the trainer is built, before accelerate prepares the model (and before it sets
    the accelerator's ``deepspeed_config``): from accelerate's state."""
    from posttrain.core.errors import StageError

    plugin = SimpleNamespace(zero_stage=zero_stage) if zero_stage else None
    kwargs = {"distributed_type": distributed_type, "state": SimpleNamespace(deepspeed_plugin=plugin)}
    if refused is None:
        refresher(tiny_tokenizer, 0.5, {"a": 7}, ["a"], trainer_kwargs=kwargs)
        return
    with pytest.raises(
        StageError, match=rf"^\[grpo-fresh\] pass_rate.refresh_every: .* shards it \({refused}\)"
    ):
        refresher(tiny_tokenizer, 0.5, {"a": 7}, ["a"], trainer_kwargs=kwargs)


def test_up_to_half_a_refresh_is_the_pools_least_recently_scored(tiny_tokenizer):
    pool = [f"p{i}" for i in range(6)]
    refresh, _ = refresher(
        tiny_tokenizer, 0.75, {**dict.fromkeys(pool, 7), "c0": 9, "c1": 9, "c2": 9}, pool, refresh_size=6
    )
    first = refresh.refresh(step=2)
    second = refresh.refresh(step=4)
    assert first["scored"] == second["scored"] == 6
    scored_first = {pid for pid, step in refresh.scored_at.items() if step == 2}
    scored_second = {pid for pid, step in refresh.scored_at.items() if step == 4}
    assert len(scored_first) == len(scored_second) == 3 and not scored_first & scored_second


def test_the_refresh_runs_every_n_steps_but_not_after_the_last(tiny_tokenizer):
    refresh, _ = refresher(tiny_tokenizer, 0.75, {"a": 7, "b": 9}, ["a"])
    steps = []
    refresh.refresh = lambda step: steps.append(step)
    for step in range(1, 7):
        refresh.on_step_end(None, SimpleNamespace(global_step=step, max_steps=6), None)
    assert steps == [2, 4]


def test_refresh_every_needs_a_sampler_that_can_swap_prompts():
    with pytest.raises(ValueError, match=r"pass_rate.refresh_every: needs zero_signal: drop or resample"):
        GRPOStageConfig(
            name="fresh",
            rewards=[{"name": "correctness"}],
            pass_rate=PassRateConfig(refresh_every=2),
            zero_signal="keep",
        )


def test_a_stage_that_refreshes_its_pool_logs_it_and_never_trains_a_prompt_after_it_left(
    tiny_model_dir, tiny_tokenizer, tmp_path
):
    """The whole stage on the tiny random model, which solves nothing: at the refresh every pool
    prompt it scores has a pass rate of 0 and leaves, and no later batch holds one of them."""
    from posttrain.core.config import DataConfig, ModelConfig, SyntheticConfig
    from posttrain.data.pass_rates import PassRates
    from posttrain.data.prepare import prepare_data
    from posttrain.training.grpo import make_grpo_trainer
    from posttrain.training.stage_run import StageContext

    prepared = prepare_data(
        DataConfig(source="synthetic", synthetic=SyntheticConfig(num_examples=24), eval_size=4),
        tiny_tokenizer,
    ).train
    ids = [str(i) for i in prepared["id"]]
    rates = PassRates(4, {pid: 2 for pid in ids[:6]})
    cfg = GRPOStageConfig(
        name="fresh",
        rewards=[{"name": "correctness"}],
        pass_rate=PassRateConfig(samples=4, refresh_every=1, refresh_size=4),
        zero_signal="drop",
        trainer={
            "max_steps": 3,
            "num_generations": 2,
            "per_device_train_batch_size": 4,
            "max_completion_length": 8,
            "logging_steps": 1,
        },
    )
    ctx = StageContext(stage="grpo-fresh", work_dir=tmp_path, seed=0, report_to="none", precision="fp32")
    trainer, _ = make_grpo_trainer(
        cfg, ModelConfig(name=str(tiny_model_dir)), str(tiny_model_dir), prepared, ctx, pass_rates=rates
    )
    refreshes = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, PoolRefresh)]
    assert len(refreshes) == 1
    batches = []
    generate = trainer._posttrain_generate

    def spy(inputs):
        batches.append((trainer.state.global_step, [str(row["id"]) for row in inputs]))
        return generate(inputs)

    trainer._posttrain_generate = spy
    trainer.train()
    history = refreshes[0].history
    assert [r["step"] for r in history] == [1, 2]
    left = {pid: r["step"] for r in history for pid in r["left"]}
    assert left, "the random model solves nothing, so scored pool prompts leave"
    for step, batch in batches:
        assert not {pid for pid in batch if pid in left and left[pid] < step + 1}, (step, batch)
    logged = [row for row in trainer.state.log_history if "pass_rate/pool" in row]
    assert [row["step"] for row in logged] == [1, 2]


POOL = [f"p{i}" for i in range(6)]
GOLDS = {**dict.fromkeys(POOL, 7), "never": 9, **{f"c{i}": 7 for i in range(6)}}


def worked_pool(tokenizer):
    """A refresh and its sampler two steps into a stage: partway through the fresh order, one
    prompt retired, a run of flat groups counted, and a refresh that retired and admitted prompts."""
    refresh, trainer = refresher(tokenizer, 0.75, GOLDS, POOL, refresh_size=6)
    sampler = trainer._posttrain_sampler
    sampler.fresh.take(2)
    sampler.retire("p5", "test")
    sampler._replace_retired([{"id": "p5"}] * 2)  # p5's stand-in
    sampler.flat_streak["p4"] = 1
    record = refresh.refresh(step=2)
    assert record["joined"], "the test needs a prompt waiting in the joined queue"
    return refresh, sampler


def test_a_checkpointed_pool_comes_back_as_it_was(tiny_tokenizer):
    """The pool's state goes through JSON with sorted keys (as transformers writes the trainer
    state) and comes back: the next fresh draws and the next refresh are the original's."""
    refresh, sampler = worked_pool(tiny_tokenizer)
    state = SimpleNamespace(stateful_callbacks={}, global_step=2)
    PoolCheckpoint(sampler, refresh).on_step_end(None, state, None)
    saved = json.loads(json.dumps(state.stateful_callbacks, sort_keys=True))
    again, trainer = refresher(tiny_tokenizer, 0.75, GOLDS, POOL, refresh_size=6)
    again_sampler = trainer._posttrain_sampler
    PoolCheckpoint(again_sampler, again).on_train_begin(
        None, SimpleNamespace(stateful_callbacks=saved, global_step=2), None
    )
    assert again_sampler.state() == sampler.state()
    assert list(again.scored_at.items()) == list(refresh.scored_at.items())  # ties keep their order

    def ids(rows):
        return [row["id"] for row in rows]

    def next_batch(sampler):
        return ids(sampler._replace_retired([{"id": pid} for pid in sampler.retired for _ in range(2)])[0])

    assert next_batch(again_sampler) == next_batch(sampler)  # the stand-ins, old and new
    assert ids(again_sampler.fresh.take(5, set(again_sampler.retired))) == ids(
        sampler.fresh.take(5, set(sampler.retired))
    )
    assert {**again.refresh(step=4), "seconds": 0} == {**refresh.refresh(step=4), "seconds": 0}


@pytest.mark.parametrize(
    "damage",
    [
        lambda s: s.update(version=2),
        lambda s: s.update(refresh=None),
        lambda s: s["sampler"].update(retired="p1"),
        lambda s: s["sampler"]["flat_streak"].update(p1=-1),
        lambda s: s["sampler"]["stand_ins"].append(["p5", "not-a-row"]),
        lambda s: s["sampler"]["stand_ins"].append(["never", "c0"]),  # "never" is not retired
        lambda s: s["sampler"]["fresh"].update(permutations=10**12),
        lambda s: s["sampler"]["fresh"].update(left=10**6),
        lambda s: s["sampler"]["fresh"].update(joined=["not-a-candidate"]),
        lambda s: s["refresh"]["scored_at"].append(["not-a-candidate", 0]),
        lambda s: s["refresh"]["scored_at"].append(["c5", 99]),
        lambda s: s["refresh"].update(cursor=-1),
        lambda s: s["refresh"].update(history={}),
    ],
)
def test_a_damaged_pool_state_is_said_and_changes_nothing(damage, tiny_tokenizer, caplog):
    refresh, sampler = worked_pool(tiny_tokenizer)
    saved = json.loads(json.dumps(PoolCheckpoint(sampler, refresh).state()))
    damage(saved)
    fresh, trainer = refresher(tiny_tokenizer, 0.75, GOLDS, POOL, refresh_size=6)
    before = (trainer._posttrain_sampler.state(), fresh.state())
    with caplog.at_level(logging.WARNING, logger="posttrain.training.pool_state"):
        PoolCheckpoint(trainer._posttrain_sampler, fresh, stage="grpo-fresh").on_train_begin(
            None, SimpleNamespace(stateful_callbacks={STATE_KEY: saved}, global_step=2), None
        )
    assert (trainer._posttrain_sampler.state(), fresh.state()) == before
    assert [r.message for r in caplog.records if "no usable prompt-pool state" in r.message]
