"""Config schema: every shipped config loads; overrides; TRL pass-through validation; stable hashes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from posttrain.cache.keys import stage_section
from posttrain.cli import main
from posttrain.core.config import ConfigError, apply_override, parse_config
from posttrain.core.hashing import stable_hash
from posttrain.core.trainer_options import _CHOICES
from posttrain.pipeline import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


def write(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def minimal(**extra) -> dict:
    return {"name": "t", "model": {"name": "tiny-random"}, **extra}


def grpo_stage(**trainer) -> dict:
    return {"name": "s", "rewards": [{"name": "correctness"}], "trainer": trainer}


def test_three_configs_ship():
    assert {p.name for p in CONFIGS} >= {
        "smoke.yaml",
        "smollm2-gsm8k-cpu.yaml",
        "qwen2.5-0.5b-gsm8k-gpu.yaml",
    }


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_validates(path, in_clone_with_gsm8k):
    cfg = load_config(path)
    assert cfg.name == path.stem
    assert cfg.stage_names(), "a shipped config should train something"


@pytest.mark.parametrize(
    "data, fragment",
    [
        (
            minimal(grpo={"stages": [grpo_stage(kl_coef=0.1)]}),
            "grpo.stages.0.trainer: unknown GRPOConfig option 'kl_coef': the KL coefficient is `beta`",
        ),  # renamed option
        (
            minimal(grpo={"stages": [grpo_stage(num_generations=1)]}),
            "must be >= 2 (GRPO compares completions",
        ),  # TRL's own check
        (
            minimal(grpo={"stages": [grpo_stage(scale_rewards="nonsense")]}),
            "grpo.stages.0.trainer: option 'scale_rewards' must be one of 'group', 'batch', 'none', got 'nonsense'",
        ),  # TRL checks it only at the first step
        (
            minimal(grpo={"stages": [grpo_stage(loss_type="drgrpo")]}),
            "option 'loss_type' must be one of 'grpo', 'dr_grpo'",
        ),  # TRL checks it only in the loss
        (
            minimal(grpo={"stages": [grpo_stage(num_generations=3, per_device_train_batch_size=4)]}),
            "divisible by num_generations",
        ),  # cross-field
        (
            minimal(grpo={"stages": [grpo_stage(learning_rat=1e-5)]}),
            "did you mean 'learning_rate'",
        ),  # typo suggestion
        (
            minimal(grpo={"stages": [grpo_stage(max_steps="many")]}),
            "option 'max_steps': Input should be a valid integer",
        ),  # type
        (minimal(grpo={"stages": [grpo_stage(bf16=True)]}), "set model.precision"),  # managed key
        (
            minimal(grpo={"stages": [grpo_stage(max_prompt_length=64)]}),
            "never truncates prompts",
        ),  # TRL 1.16 has none
        (
            minimal(sft={"trainer": {"max_new_tokens": 5}}),
            "sft.trainer: unknown SFTConfig option 'max_new_tokens'",
        ),  # SFT
        (minimal(dpo={"trainer": {"betta": 0.1}}), "did you mean 'beta'"),  # DPO typo
        (
            minimal(grpo={"stages": [{"name": "s", "rewards": [{"name": "nope"}]}]}),
            "unknown reward 'nope'; valid rewards: ",
        ),  # registry
        (minimal(grpo={"stages": [{"name": "s", "rewards": []}]}), "grpo.stages.0.rewards"),  # no reward
        (minimal(grpo={"stages": [grpo_stage(), grpo_stage()]}), "repeated: s"),  # duplicate stage names
        (minimal(data={"source": "local"}), "needs `path`"),  # local without path
        (minimal(modle={}), "modle: unknown key"),  # top-level typo
        (minimal(eval={"pass_k": 4}), "temperature > 0"),  # pass@k needs sampling
        ({"name": "t", "model": {"name": "m", "quantization": "4bit"}}, "QLoRA"),  # 4bit without LoRA
        (
            {"name": "t", "model": {"name": "m", "lora": {"r": 8, "use_rslor": True}}},
            "model.lora: unknown LoraConfig option 'use_rslor' (did you mean 'use_rslora'",
        ),  # peft option typo
        (
            {"name": "t", "model": {"name": "m", "lora": {"use_dora": "maybe"}}},
            "model.lora: option 'use_dora': Input should be a valid boolean",
        ),  # peft option type
        (
            {"name": "t", "model": {"name": "m", "lora": {"task_type": "SEQ_CLS"}}},
            "'task_type' is managed by posttrain",
        ),  # managed peft key
        (
            {"name": "t", "model": {"name": "m", "lora": {"layers_pattern": "layers"}}},
            "LoraConfig rejects these options: `layers_pattern` cannot be used",
        ),  # peft's own __post_init__ check
        (
            {"name": "t", "model": {"name": "m", "lora": {"alpha": 8, "lora_alpha": 16}}},
            "give 'alpha' or peft's 'lora_alpha', not both",
        ),  # both spellings
        (
            minimal(data={"synthetic": {"min_steps": 2}}),
            "data.synthetic.min_steps: renamed to 'min_ops' (arithmetic operations per problem)",
        ),  # renamed key
        (
            minimal(grpo={"stages": [{**grpo_stage(), "data_filter": {"max_steps": 2}}]}),
            "grpo.stages.0.data_filter.max_steps: renamed to 'max_ops'",
        ),  # renamed key in a stage
        (
            minimal(grpo={"defaults": {"trainer": {"learning_rate": -1}}, "stages": [grpo_stage()]}),
            "grpo.defaults.trainer: option 'learning_rate' must be > 0",
        ),  # an error in a default names the default, not the stage that inherited it
        (
            minimal(
                grpo={
                    "defaults": {"trainer": {"learning_rate": 1e-5}},
                    "stages": [grpo_stage(learning_rate=-1)],
                }
            ),
            "grpo.stages.0.trainer: option 'learning_rate' must be > 0",
        ),  # the stage's own value: the stage
        (
            minimal(grpo={"defaults": {"monitor": {"window": 1}}, "stages": [grpo_stage()]}),
            "grpo.defaults.monitor.window: Input should be greater than or equal to 2",
        ),  # a nested default
        (
            minimal(grpo={"defaults": {"data_filter": {"num_examples": 2}}, "stages": [grpo_stage()]}),
            "grpo.defaults.data_filter.num_examples: renamed to 'limit'",
        ),  # a renamed key among the defaults
        (
            minimal(grpo={"defaults": {"tools": ["abacus"]}, "stages": [grpo_stage()]}),
            "grpo.defaults: tools: unknown inline tool 'abacus'",
        ),  # a stage-wide check about a default
        (
            minimal(grpo={"defaults": {"modle": 1}, "stages": [grpo_stage()]}),
            "grpo.defaults.modle: unknown key",
        ),
        (
            minimal(grpo={"defaults": {"name": "x"}, "stages": [grpo_stage()]}),
            "grpo.defaults.name: each stage names itself",
        ),  # a name is never shared
        (
            minimal(grpo={"defaults": {"keep": "best", "eval_every": 2}, "stages": [grpo_stage()]}),
            "grpo.defaults.keep: best needs data.selection_size",
        ),  # a check across sections after validation
    ],
)
def test_bad_configs_fail_in_one_line_naming_the_key(tmp_path, data, fragment):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, data))
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message
    assert message.startswith(str(tmp_path / "cfg.yaml"))


@pytest.mark.parametrize("key", sorted(_CHOICES["grpo"]))
def test_the_grpo_choices_are_the_ones_trl_documents_and_each_validates(key):
    """The load-time lists stay TRL's: each value is named in the field's help and passes TRL's config."""
    from dataclasses import fields

    from trl import GRPOConfig

    help_text = next(f.metadata["help"] for f in fields(GRPOConfig) if f.name == key)
    for choice in _CHOICES["grpo"][key]:
        assert re.search(rf"\b{choice}'", help_text), (key, choice)  # TRL's help quotes them ('x', `x'`)
        parse_config(minimal(grpo={"stages": [grpo_stage(**{key: choice})]}))


def test_grpo_defaults_merge_under_each_stage_as_if_written_out():
    """Stage keys win; trainer/monitor/data_filter merge key by key; lists and lora are replaced
    (lora: null included). The merged stage is the stage written out: same object, same hash."""
    defaults = {
        "rewards": [{"name": "correctness"}, {"name": "strict_format", "weight": 0.1}],
        "trainer": {"learning_rate": 1e-4, "max_steps": 8},
        "monitor": {"window": 5},
        "lora": {"r": 4},
        "tools": ["calculator"],
        "eval_limit": 32,
    }
    stages = [
        {"name": "a"},
        {
            "name": "b",
            "rewards": [{"name": "xml_count"}],
            "trainer": {"learning_rate": 5e-5},
            "monitor": {"kl_threshold": 2.0},
            "lora": None,
            "tools": [],
        },
    ]
    written_out = [
        {"name": "a", **defaults},
        {
            **defaults,
            "name": "b",
            "rewards": [{"name": "xml_count"}],
            "trainer": {"learning_rate": 5e-5, "max_steps": 8},
            "monitor": {"window": 5, "kl_threshold": 2.0},
            "lora": None,
            "tools": [],
        },
    ]
    cfg = parse_config(minimal(grpo={"defaults": defaults, "stages": stages}))
    plain = parse_config(minimal(grpo={"stages": written_out}))
    assert cfg.grpo.stages == plain.grpo.stages
    for name in ("grpo-a", "grpo-b"):
        assert stable_hash(stage_section(cfg, name)) == stable_hash(stage_section(plain, name))
    b = cfg.grpo.stages[1]
    assert b.trainer == {"learning_rate": 5e-5, "max_steps": 8} and b.lora is None and b.tools == []
    assert (b.monitor.window, b.monitor.kl_threshold) == (5, 2.0)
    assert "defaults" not in cfg.grpo.model_dump(mode="json")  # what ran: the resolved stages
    assert (
        parse_config(yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json")))).grpo.stages
        == cfg.grpo.stages
    )


def test_overrides_reach_defaults_and_single_stages(smoke_config_path):
    cfg = load_config(
        smoke_config_path,
        ["grpo.defaults.trainer.learning_rate=2e-5", "grpo.stages.1.trainer.max_steps=3"],
    )
    first, second = cfg.grpo.stages
    assert first.trainer["learning_rate"] == second.trainer["learning_rate"] == 2e-5
    assert (first.trainer["max_steps"], second.trainer["max_steps"]) == (2, 3)
    assert second.trainer["num_generations"] == 4  # the default's other options stay


def test_a_stage_lora_overrides_model_lora_for_that_stage_only():
    """Unset follows model.lora; a mapping is that stage's adapter; null is its full model, which under
    adapter_policy: adapter saves the whole model like any full fine-tuning (not refused)."""
    model = {"name": "tiny-random", "lora": {"r": 8}, "adapter_policy": "adapter"}
    cfg = parse_config(
        minimal(
            model=model,
            sft={"lora": None},
            grpo={"stages": [grpo_stage(), {**grpo_stage(), "name": "b", "lora": {"r": 2}}]},
        )
    )
    sft, first, second = (section for _, section in cfg.stage_sections())
    assert cfg.model_for(sft).lora is None and cfg.model_for(sft).adapter_policy == "adapter"
    assert cfg.model_for(first) is cfg.model and cfg.model_for(second).lora.r == 2
    with pytest.raises(ConfigError, match=r"x.yaml: sft.lora: null \(full fine-tuning\) cannot train a 4bit"):
        parse_config(minimal(model={**model, "quantization": "4bit"}, sft={"lora": None}), "x.yaml")


def test_lora_passes_peft_options_through_by_peft_names():
    from posttrain.models.loading import build_peft_config

    lora = {"r": 8, "use_rslora": True, "target_modules": ["q_proj", "v_proj"], "lora_dropout": 0.0}
    cfg = parse_config(minimal(model={"name": "tiny-random", "lora": lora}))
    peft = build_peft_config(cfg.model.lora)
    assert (peft.r, peft.use_rslora, peft.lora_dropout, peft.task_type) == (8, True, 0.0, "CAUSAL_LM")
    assert peft.target_modules == {"q_proj", "v_proj"} and peft.lora_alpha == 32  # posttrain's default
    again = parse_config(yaml.safe_load(yaml.safe_dump(cfg.model_dump(mode="json"))))
    assert again == cfg and stable_hash(again.model) == stable_hash(cfg.model)  # round-trips, hashed
    assert stable_hash(cfg.model) != stable_hash(
        parse_config(minimal(model={"name": "tiny-random", "lora": {"r": 8}})).model
    )


def test_trainer_values_are_coerced_from_yaml_strings(tmp_path):
    # YAML 1.1 reads 5e-6 (no dot) as a string; TRL would keep it as one.
    path = tmp_path / "c.yaml"
    path.write_text(
        "name: t\nmodel: {name: tiny-random}\ngrpo:\n  stages:\n"
        "    - {name: s, rewards: [{name: correctness}], trainer: {learning_rate: 5e-6}}\n"
    )
    assert load_config(path).grpo.stages[0].trainer["learning_rate"] == 5e-6


@pytest.mark.parametrize(
    "override, check",
    [
        (
            "grpo.stages.0.trainer.learning_rate=1e-5",
            lambda c: c.grpo.stages[0].trainer["learning_rate"] == 1e-5,
        ),  # list index
        ("model.lora.r=4", lambda c: c.model.lora.r == 4),  # nested
        ("model.lora=null", lambda c: c.model.lora is None),  # YAML scalar null
        ("eval.limit=7", lambda c: c.eval.limit == 7),  # int
        (
            "data.system_prompt=Be brief: answer",
            lambda c: c.data.system_prompt == "Be brief: answer",
        ),  # string with colon
        ("sft.enabled=false", lambda c: c.stage_names()[0] == "dpo"),  # bool
    ],
)
def test_overrides(smoke_config_path, override, check):
    cfg = load_config(smoke_config_path, [override])
    assert check(cfg)


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("grpo.stages.9.name=x", "not an index of a list of 2"),  # out of range
        ("noequals", "dotted.key=value"),  # malformed
        ("seed.x=1", "'seed' is a value"),  # descending into a scalar
    ],
)
def test_bad_overrides(smoke_config_path, override, fragment):
    with pytest.raises(ConfigError, match=fragment):
        load_config(smoke_config_path, [override])


def test_override_fills_a_null_section():
    raw = {"sft": None}
    apply_override(raw, "sft.limit=3")
    assert raw == {"sft": {"limit": 3}}


def test_section_hashes_are_stable_and_local():
    base = parse_config(minimal(grpo={"stages": [grpo_stage(), {**grpo_stage(), "name": "t"}]}))
    changed = parse_config(minimal(grpo={"stages": [grpo_stage(), {**grpo_stage(max_steps=3), "name": "t"}]}))
    section_hash = lambda cfg, name: stable_hash(stage_section(cfg, name))  # noqa: E731
    assert section_hash(base, "grpo-s") == section_hash(changed, "grpo-s")
    assert section_hash(base, "grpo-t") != section_hash(changed, "grpo-t")
    assert stable_hash(base.model) == stable_hash(
        {"name": "tiny-random"} | base.model.model_dump(mode="json")
    )
    assert len(stable_hash(base.eval)) == 16


def test_invalid_yaml_names_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: t\nmodel:\n  name: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:\d+: invalid YAML"):
        load_config(path)


def test_cli_validate_exit_codes(tmp_path, capsys, in_clone_with_gsm8k):
    assert main(["validate", *map(str, CONFIGS)]) == 0
    bad = write(tmp_path, minimal(grpo={"stages": [grpo_stage(kl_coef=0.1)]}))
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "kl_coef" in err


DOCS_CONFIG = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def _schema_keys(model_cls, path: str = "") -> dict[str, object]:
    """Every key of the schema as a dotted path (``[]`` after a list of mappings) -> its field,
    walked here rather than by the generator under test."""
    import types
    import typing

    from pydantic import BaseModel

    keys: dict[str, object] = {}
    for name, field in model_cls.model_fields.items():
        key = f"{path}.{name}" if path else name
        keys[key] = field
        annotation = field.annotation
        is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        for arg in typing.get_args(annotation) if is_union else (annotation,):
            is_list = typing.get_origin(arg) is list
            for cls in typing.get_args(arg) if is_list else (arg,):
                if isinstance(cls, type) and issubclass(cls, BaseModel):
                    keys |= _schema_keys(cls, key + ("[]" if is_list else ""))
    return keys


def test_docs_config_reference_is_current():
    from posttrain.core.config_reference import config_sections, render_markdown

    assert DOCS_CONFIG.read_text() == render_markdown(config_sections()), (
        "docs/config.md is stale: regenerate it with `posttrain config --markdown > docs/config.md`"
    )


def test_docs_config_reference_names_every_key():
    from posttrain.core.config import PipelineConfig

    reference = DOCS_CONFIG.read_text()
    keys = _schema_keys(PipelineConfig)
    assert {"grpo.stages[].rewards[].weight", "eval.extra_sets[].name", "model.lora.r"} <= set(keys)
    missing = sorted(k for k in keys if f"**`{k}`**" not in reference)
    assert not missing, f"docs/config.md does not describe: {missing}"


def test_every_config_key_has_a_docstring():
    from posttrain.core.config import PipelineConfig

    bare = sorted(k for k, field in _schema_keys(PipelineConfig).items() if not field.description)
    assert not bare, f"config keys without a docstring (say what the key does and why): {bare}"
