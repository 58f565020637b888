"""`posttrain config`: the reference generated from the schema's docstrings, one section or key at a time.

That docs/config.md is current and names every key is checked in tests/unit/test_config.py.
"""

from __future__ import annotations

import pytest

from posttrain.cli import main
from posttrain.core.config import PipelineConfig, read_config_mapping
from posttrain.core.config_reference import config_sections, render_markdown, render_text, select

SECTIONS = config_sections()


@pytest.mark.parametrize(
    ("name", "paths"),
    [
        (
            "grpo.stages",
            [
                "grpo.stages[]",
                "grpo.stages[].launch",
                "grpo.stages[].lora",
                "grpo.stages[].rewards[]",
                "grpo.stages[].data",
                "grpo.stages[].data.synthetic",
                "grpo.stages[].data_filter",
                "grpo.stages[].monitor",
                "grpo.stages[].pass_rate",
                "grpo.stages[].rft",
            ],
        ),
        ("grpo.stages[]", None),  # the list marker is optional
        ("grpo.stages.0", None),  # so is an index, as --set writes it
        ("grpo.stages.0.monitor", ["grpo.stages[].monitor"]),
        ("launch", ["launch"]),  # not sft.launch or grpo.stages[].launch
        ("model", ["model", "model.lora"]),
    ],
)
def test_select_a_section_and_what_it_holds(name, paths):
    chosen = [s.path for s in select(SECTIONS, name)]
    assert chosen == (paths or [s.path for s in select(SECTIONS, "grpo.stages")])


@pytest.mark.parametrize(
    ("name", "key"),
    [
        ("model.precision", "model.precision"),
        ("grpo.stages.1.trainer", "grpo.stages[].trainer"),  # a key under a list, by index
        ("eval.extra_sets[].name", "eval.extra_sets[].name"),
    ],
)
def test_select_one_key(name, key):
    (section,) = select(SECTIONS, name)
    assert [k.path for k in section.keys] == [key]


def test_select_unknown_is_empty():
    assert select(SECTIONS, "grpo.stage") == []
    assert select(SECTIONS, "model.precisio") == []


def test_trainer_keys_show_posttrains_defaults_and_the_trl_class():
    (section,) = select(SECTIONS, "grpo.stages.0.trainer")
    doc = section.keys[0].doc
    assert "trl.GRPOConfig" in doc and '"num_generations": 8' in doc and "`output_dir`" in doc


def test_sections_follow_the_config_file():
    top = [s.path for s in SECTIONS if "." not in s.path and "[" not in s.path]
    assert top == ["", "model", "data", "sft", "dpo", "grpo", "eval", "tracking", "orchestration",
                   "launch", "vllm_server"]  # fmt: skip


def test_cli_prints_a_section(capsys):
    assert main(["config", "grpo.stages.0.monitor"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[grpo.stages[].monitor]")
    assert "grpo.stages[].monitor.kl_threshold: float, default 1.0" in out
    assert "model.name" not in out


def test_cli_markdown_is_the_docs_page(capsys):
    assert main(["config", "--markdown"]) == 0
    assert capsys.readouterr().out == render_markdown(SECTIONS)


def test_cli_unknown_section_is_one_line_exit_2(capsys):
    assert main(["config", "grpo.stage"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'grpo.stage'" in err and "grpo, eval" in err


def test_a_section_is_introduced_by_its_own_docstring_not_its_last_keys():
    top = SECTIONS[0]
    assert top.path == "" and top.doc.startswith("One whole run")
    (launch,) = select(SECTIONS, "grpo.stages.0.launch")
    assert launch.doc.startswith("How this stage is launched") and launch.keys[-1].doc not in launch.doc


def test_a_default_the_loader_fills_in_is_shown_as_one_not_as_required(tmp_path):
    """`name` may be left out (the file's stem fills it in), so the reference must not call it required."""
    (section,) = select(SECTIONS, "name")
    assert section.keys[0].default != "required" and section.keys[0].derived_from == "the config file's stem"
    assert "(`str`, default: the config file's stem)" in render_markdown([section])
    assert "  name: str, default: the config file's stem\n" in render_text([section])
    config = tmp_path / "my-run.yaml"
    config.write_text("model: {name: tiny-random}\n")
    assert read_config_mapping(config)["name"] == "my-run"


@pytest.mark.parametrize("stage", ["sft", "dpo", "grpo.stages[]"])
def test_a_stage_lora_left_out_is_shown_as_following_model_lora_not_as_null(stage):
    """Absent, a stage's `lora` follows `model.lora` (`null` would train the full model): the
    reference must say so, and the config must behave as it says."""
    keys = {k.path: k for s in SECTIONS if s.path == stage for k in s.keys}
    assert keys[f"{stage}.lora"].derived_from == "as model.lora"
    assert keys[f"{stage}.launch"].derived_from == "as the top-level launch"
    (parent,) = [s for s in SECTIONS if s.path == stage]
    assert f"  {stage}.lora: mapping | null, default: as model.lora\n" in render_text([parent])
    assert f"- **`{stage}.lora`** (`mapping | null`, default: as model.lora)" in render_markdown([parent])
    lora = {"r": 4, "alpha": 8}
    config = PipelineConfig.model_validate(
        {
            "name": "x",
            "model": {"name": "tiny-random", "lora": lora},
            "sft": {},
            "dpo": {},
            "grpo": {"stages": [{"name": "a", "rewards": [{"name": "correctness"}]}]},
        }
    )
    section = config.grpo.stages[0] if stage.startswith("grpo") else getattr(config, stage)
    assert config.model_for(section).lora == config.model.lora
