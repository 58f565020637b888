"""Cache keys without Prefect: each step's key changes exactly with what its output depends on.

The pipeline tests check this end to end through the flow (minutes); these check every ingredient
of every kind of key directly (milliseconds), which is also what mutation testing runs.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import posttrain
from posttrain.cache.keys import (
    cache_key,
    data_identity,
    data_key,
    eval_identity,
    eval_key,
    stage_section,
    train_identity,
    train_key,
)
from posttrain.core.config import GRPOSection, GRPOStageConfig, cache_form
from posttrain.core.hashing import stable_hash
from posttrain.core.sweep import seed_group
from posttrain.pipeline import load_config

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture(scope="module")
def smoke(smoke_config_path):
    """``smoke(*overrides)``: the smoke config with ``overrides``."""
    return lambda *overrides: load_config(smoke_config_path, list(overrides))


def test_cache_key_format_is_pinned(monkeypatch):
    """Keys are stored in every store's records: a change to how they are built silently reruns every
    cached step of every user, so it must be deliberate (update these values when it is)."""
    monkeypatch.setattr(posttrain, "__version__", "0.0.0")
    inputs = {"model": "m", "data": "d"}
    assert cache_key("sft", "h", inputs, "c") == "38bda2b6eb9b2157fb19ce86"
    assert cache_key("sft", "h", inputs) == "7afd355820f36207a1341001"


def test_cache_key_includes_code_and_version(monkeypatch):
    inputs = {"model": "m"}
    with_code = cache_key("sft", "h", inputs, "code-a")
    assert with_code != cache_key("sft", "h", inputs, "code-b") != cache_key("sft", "h", inputs)
    assert cache_key("sft", "h", inputs, "") == cache_key("sft", "h", inputs)  # the lineage: no code
    monkeypatch.setattr(posttrain, "__version__", "999")
    assert cache_key("sft", "h", inputs, "code-a") != with_code


def test_stage_section_finds_each_training_stage_by_step_name(smoke):
    cfg = smoke()
    assert stage_section(cfg, "sft") is cfg.sft and stage_section(cfg, "dpo") is cfg.dpo
    assert stage_section(cfg, "grpo-correctness") is cfg.grpo.stages[1]
    with pytest.raises(KeyError, match="grpo-nope"):
        stage_section(cfg, "grpo-nope")
    assert stage_section(smoke("dpo=null"), "grpo-format").name == "format"


def test_data_identity_names_its_step_config_and_inputs(smoke):
    cfg = smoke()
    identity = data_identity(cfg, "tok")
    assert identity.step == "data" and identity.config_hash == stable_hash(cache_form(cfg.data))
    assert identity.inputs == {"source": "-", "tokenizer": "tok"}  # synthetic data: no file to hash
    assert data_key(cfg, "tok") == identity.key != data_key(cfg, "other-tok")
    assert data_key(smoke("data.eval_size=4"), "tok") != identity.key
    assert data_key(smoke("data.seed=1"), "tok") != identity.key  # the split and the generator
    assert data_key(smoke("seed=1"), "tok") == identity.key  # a seed sweep shares the data step
    assert data_key(smoke("data.synthetic.themes=[farm]"), "tok") != identity.key  # other problems
    assert identity.code.files and identity.key != identity.lineage


def test_the_data_step_is_keyed_by_the_problems_of_every_set_it_decontaminates_against(smoke):
    """The data step removes each external evaluation set's questions from training: another
    story, number range or operation count there is other questions to remove."""

    def key(**fields: str) -> str:
        unseen = ", ".join(f"{k}: {v}" for k, v in {"max_ops": "2", **fields}.items())
        return data_key(smoke(f"eval.extra_sets=[{{name: unseen, data: synthetic, {unseen}}}]"), "tok")

    plain = key()
    assert plain != data_key(smoke(), "tok")
    changed = [key(themes="[farm]"), key(themes="[farm, travel]"), key(numbers="small"), key(max_ops="3")]
    assert len({plain, *changed}) == 5
    assert key(themes="[farm]") == changed[0]  # a key, not a draw


def test_a_stages_own_source_is_keyed_in_the_data_step_and_in_that_stage(smoke, tmp_path):
    answers = tmp_path / "answers.jsonl"
    answers.write_text('{"question": "q", "answer": "#### 1"}\n')
    own_source = f"grpo.stages.1.data={{source: local, path: {answers}}}"
    plain, own = data_identity(smoke(), "tok"), data_identity(smoke(own_source), "tok")
    assert own.config_hash == plain.config_hash  # the run's data section is as it was
    assert set(own.inputs) - set(plain.inputs) == {"stage_sources"} and own.key != plain.key
    answers.write_text('{"question": "q", "answer": "#### 2"}\n')
    assert data_identity(smoke(own_source), "tok").key != own.key  # the file's content, not its path
    args = ("grpo-correctness", "model-fp", "data-fp")
    assert train_key(smoke(own_source), *args) != train_key(smoke(), *args)
    assert train_key(smoke("grpo.stages.1.data=null"), *args) == train_key(smoke(), *args)


def _local(smoke, path: Path) -> str:
    return data_identity(smoke("data.source=local", f"data.path={path}"), "tok").inputs["source"]


def test_local_data_is_keyed_by_file_content_not_path(smoke, tmp_path):
    one = tmp_path / "a" / "train.jsonl"
    one.parent.mkdir()
    one.write_text('{"question": "q", "answer": "#### 1"}\n')
    fingerprint = _local(smoke, one)
    assert len(fingerprint) == 16 and fingerprint != "-"
    moved = tmp_path / "b" / "train.jsonl"
    moved.parent.mkdir()
    moved.write_bytes(one.read_bytes())
    assert _local(smoke, moved) == fingerprint  # same content elsewhere
    one.write_text('{"question": "q", "answer": "#### 2"}\n')
    assert _local(smoke, one) != fingerprint  # same path, new content
    synthetic = smoke("data.source=synthetic", f"data.path={one}")  # a path left over from local data
    assert data_identity(synthetic, "tok").inputs["source"] == "-"


def test_a_data_folder_is_keyed_by_its_jsonl_files(smoke, tmp_path):
    (tmp_path / "part-1.jsonl").write_text('{"question": "q1", "answer": "#### 1"}\n')
    before = _local(smoke, tmp_path)
    (tmp_path / "notes.txt").write_text("not data")
    assert _local(smoke, tmp_path) == before
    (tmp_path / "part-2.jsonl").write_text('{"question": "q2", "answer": "#### 2"}\n')
    with_two = _local(smoke, tmp_path)
    assert with_two != before
    (tmp_path / "part-2.jsonl").rename(tmp_path / "part-3.jsonl")
    assert _local(smoke, tmp_path) != with_two  # renamed: another file of the folder


def test_train_identity_depends_on_its_section_trainer_model_seed_and_inputs(smoke):
    cfg = smoke()
    identity = train_identity(cfg, "grpo-format", "model-fp", "data-fp")
    assert identity.step == "grpo-format" and identity.inputs == {"model": "model-fp", "data": "data-fp"}
    key = train_key(cfg, "grpo-format", "model-fp", "data-fp")
    assert key == identity.key
    for changed in (
        smoke("grpo.stages.0.rewards.1.weight=0.25"),  # the stage's own section
        smoke("grpo.stages.0.trainer.learning_rate=0.5"),  # its trainer options
        smoke("model.lora.r=4"),  # the model section
        smoke("seed=1"),
    ):
        assert train_key(changed, "grpo-format", "model-fp", "data-fp") != key
    assert train_key(cfg, "grpo-format", "other", "data-fp") != key
    assert train_key(cfg, "grpo-format", "model-fp", "other") != key
    # Another stage's section, the data and eval sections are not its inputs.
    for unchanged in (smoke("grpo.stages.1.rewards.1.weight=0.25"), smoke("eval.limit=3")):
        assert train_key(unchanged, "grpo-format", "model-fp", "data-fp") == key
    assert train_key(cfg, "grpo-correctness", "model-fp", "data-fp") != key


def test_a_stages_own_lora_keys_that_stage_and_an_unset_one_keeps_old_keys(smoke):
    """``lora:`` in a stage section is what that stage trains (full model or adapter); leaving it
    out must keep every key of configs written before stages could set it."""
    cfg = smoke()
    key = train_key(cfg, "grpo-format", "model-fp", "data-fp")
    assert "lora" not in stage_section(cfg, "grpo-format").model_dump(mode="json")
    # Stating model.lora again changes nothing; full fine-tuning or another adapter does.
    assert (
        train_key(
            smoke("grpo.stages.0.lora={r: 8, alpha: 16, dropout: 0.0}"), "grpo-format", "model-fp", "data-fp"
        )
        == key
    )
    for changed in (smoke("grpo.stages.0.lora=null"), smoke("grpo.stages.0.lora={r: 4}")):
        assert train_key(changed, "grpo-format", "model-fp", "data-fp") != key
        assert train_key(changed, "grpo-correctness", "model-fp", "data-fp") == train_key(
            cfg, "grpo-correctness", "model-fp", "data-fp"
        )


def test_a_custom_reward_module_is_part_of_the_stage_code(smoke):
    cfg = smoke()
    stage = GRPOStageConfig(name="own", rewards=[{"name": "my_rewards.scoring:score"}])
    cfg = cfg.model_copy(update={"grpo": GRPOSection(stages=[stage])})
    files = train_identity(cfg, "grpo-own", "m", "d").code.files
    assert "custom:my_rewards.scoring" in files
    assert "custom:my_rewards.scoring" not in train_identity(cfg, "sft", "m", "d").code.files


def test_eval_identity_depends_on_eval_section_precision_and_inputs(smoke):
    cfg = smoke()
    identity = eval_identity(cfg, "eval-sft", "model-fp", "eval-fp")
    assert identity.step == "eval-sft" and identity.inputs == {"model": "model-fp", "data": "eval-fp"}
    key = eval_key(cfg, "eval-sft", "model-fp", "eval-fp")
    assert key == identity.key != eval_key(cfg, "eval-dpo", "model-fp", "eval-fp")
    assert eval_key(cfg, "eval-sft", "other", "eval-fp") != key
    assert eval_key(cfg, "eval-sft", "model-fp", "other") != key
    assert eval_key(smoke("eval.max_completion_length=12"), "eval-sft", "model-fp", "eval-fp") != key
    stories = smoke("eval.extra_sets=[{name: unseen, data: synthetic, themes: [farm]}]")
    assert eval_key(stories, "eval-sft", "model-fp", "eval-fp") != eval_key(
        smoke("eval.extra_sets=[{name: unseen, data: synthetic}]"), "eval-sft", "model-fp", "eval-fp"
    )
    assert eval_key(smoke("model.precision=bf16"), "eval-sft", "model-fp", "eval-fp") != key
    for unchanged in (smoke("sft.trainer.learning_rate=0.5"), smoke("model.lora.r=4")):  # weights say it
        assert eval_key(unchanged, "eval-sft", "model-fp", "eval-fp") == key


def test_a_stage_that_keeps_its_best_checkpoint_has_the_choice_in_its_key(smoke):
    """keep, select_metric, patience and eval_every choose the output; the selection slice's content
    (and SFT's and DPO's evaluation length) too, but only for keep: best."""
    base = ["data.selection_size=4"]
    best = [*base, "grpo.stages.0.keep=best", "grpo.stages.0.eval_every=2"]

    def key(*overrides: str, selection: str = "sel-a", stage: str = "grpo-format") -> str:
        return train_identity(smoke(*overrides), stage, "m", "d", selection).key

    plain = key(*base)
    assert plain == key(*base, selection="sel-b")  # keep: last never reads the slice
    assert plain == train_identity(smoke(), "grpo-format", "m", "d").key  # nor does the data setting
    assert key(*best) != plain  # the choice itself
    assert key(*best) != key(*best, selection="sel-b")  # which records it chose on
    assert key(*best) != key(*best, "grpo.stages.0.select_metric=format")
    assert key(*best) != key(*best, "grpo.stages.0.patience=2")
    assert key(*best) != key(*best[:-1], "grpo.stages.0.eval_every=3")
    assert key(*best) == key(*best, "eval.max_completion_length=9")  # GRPO evaluates at its completion length
    sft_best = [*base, "sft.keep=best", "sft.eval_every=2"]
    assert key(*sft_best, stage="sft") != key(*sft_best, "eval.max_completion_length=9", stage="sft")
    assert key(*base, "sft.eval_every=2", stage="sft") != key(*base, stage="sft")  # a new setting


# The config part of every step's cache identity for every shipped config (`config_hash`, not the
# code fingerprint, which changes with any code change), and the seed group MLflow runs are grouped
# by (posttrain.core.sweep.seed_group), computed before the config schema was
# renamed (issue 32: `training:` -> `launch:`, one seed, one word for counts and for completion
# length, `grpo.defaults:`). A rename that leaves what a step does as it was must leave these as
# they were, or every user's cached steps would rerun; a deliberate change of behaviour updates them.
# They hold because keys hash each section's cache form (posttrain.core.config.cache_form: a renamed
# key under the name it had when first hashed, data.seed also as the generator's old seed), and
# grpo.defaults is merged into the stages before anything is hashed. The GSM8K configs' data, eval
# and seed-group hashes changed on purpose when GSM8K moved into the clone (data/gsm8k/) and their
# GSM8K set became the test split's, evaluated on the final model only (issue 38).
PINNED_CONFIG_HASHES = {
    "qwen2.5-0.5b-gsm8k-gpu.yaml": {
        "data": "355cc3c99f732817",
        "sft": "66750947d351c7d2",
        "dpo": "3bd17d4ff16a4e19",
        "grpo-format": "fce4e1dcd70ff2dd",
        "grpo-correctness": "29313b631031db8b",
        "eval": "5a44f84a3b093a27",
        "seed_group": "259c62322758",
    },
    "smoke.yaml": {
        "data": "fbbd3151facf95c0",
        "sft": "ffb7078b5d591af4",
        "dpo": "f764c2bf8821012d",
        "grpo-format": "b63d4cfe5f87f8a5",
        "grpo-correctness": "24fdb1ecbd83ee66",
        "eval": "03f0a046e815ec7a",
        "seed_group": "84c69318d4fd",
    },
    # Its stages changed on purpose: one GRPO stage with the setup reward, then SFT on 1,152
    # solutions over 144 steps (SFT given the GRPO stage's minutes won by 45 points, issue 40), then
    # the GRPO stage's LoRA rank 32 -> 8 (it held SFT's accuracy where rank 32 lost some, issue 40).
    "smollm2-arith-calc-cpu.yaml": {
        "data": "70b390f9d4f7484b",
        "sft": "2e1daac12fbf6fda",
        "grpo-ops1-3": "70bad82d248c3d99",
        "eval": "78b6211f225479dd",
        "seed_group": "9ddc21db0e67",
    },
    # Added with the GRPO stage's own `data:` source; its SFT is the calculator config's, hash and all.
    # Its stage's hash and seed group changed when the stage came to train the whole model and
    # choose by a slice of its own (docs/results/2026-12-07-new-stories-full-grpo.md), and with its
    # learning rate and its number of steps.
    "smollm2-arith-calc-new-stories-cpu.yaml": {
        "data": "1a217d5c591ca023",
        "sft": "2e1daac12fbf6fda",
        "grpo-new-stories": "23d5d0f6576c5005",
        "eval": "56eee56527611fe5",
        "seed_group": "ff56acb5b422",
    },
    # Added with the rft: stage; its data, SFT and evaluation are the config above's.
    "smollm2-arith-calc-new-stories-rft-cpu.yaml": {
        "data": "1a217d5c591ca023",
        "sft": "2e1daac12fbf6fda",
        "rft-new-stories": "89869adf3f871d99",
        "eval": "56eee56527611fe5",
        "seed_group": "9e5478a0de7c",
    },
    "smollm2-arith-cpu.yaml": {
        "data": "70b390f9d4f7484b",
        "sft": "779c1c9120d5aa1b",
        "grpo-ops1": "af9639c380a5ce40",
        "grpo-ops1-2": "91ef00bb2310a7d3",
        "grpo-ops1-3": "64eec3e4ea9e80ce",
        "eval": "0fd604cfda6c119a",
        "seed_group": "2a9a2a24c61f",
    },
    "smollm2-gsm8k-calc-cpu.yaml": {
        "data": "48b39a61846b8116",
        "sft": "456a229a3205d7a6",
        "dpo": "a53abc3a3a14dfe1",
        "grpo-format": "84b0c1cae3fac215",
        "grpo-correctness": "e316ed0ea022b74a",
        "eval": "14405804cf0a84e2",
        "seed_group": "faae009875c4",
    },
    "smollm2-gsm8k-cpu.yaml": {
        "data": "48b39a61846b8116",
        "sft": "c8651b13ab818c2f",
        "dpo": "20a0ab3bbd654ad2",
        "grpo-format": "4c65e4d806b9c1be",
        "grpo-correctness": "b113af97c0f08699",
        "eval": "c255d5e3c8e6a1c8",
        "seed_group": "c37fe60c02ec",
    },
}


def test_every_shipped_config_has_its_hashes_pinned():
    assert sorted(PINNED_CONFIG_HASHES) == sorted(p.name for p in CONFIGS.glob("*.yaml"))


@pytest.mark.parametrize("name", sorted(PINNED_CONFIG_HASHES))
def test_shipped_configs_keep_the_config_hashes_they_had_before_the_renames(name, in_clone_with_gsm8k):
    cfg = load_config(CONFIGS / name)
    found = {"data": data_identity(cfg, "m").config_hash}
    found |= {step: train_identity(cfg, step, "m", "d").config_hash for step in cfg.stage_names()}
    found["eval"] = eval_identity(cfg, "eval-baseline", "m", "d").config_hash
    found["seed_group"] = seed_group(cfg)  # runs of the config before and after still group by seed
    assert found == PINNED_CONFIG_HASHES[name]
