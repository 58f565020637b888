"""Cache keys include the code each step kind runs: a change reruns exactly the kinds it can affect."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import posttrain
from posttrain.cache import code
from posttrain.cache.code import CodeFingerprint, code_fingerprint, module_closure
from posttrain.rewards.registry import CUSTOM_CODE_ENV

KINDS = ("data", "eval", "sft", "dpo", "grpo")


def closure(kind: str) -> set[str]:
    return set(module_closure(code.ENTRY_MODULES[kind], exclude=code.NOT_CALLED.get(kind, ())))


def test_each_kind_depends_on_its_own_code():
    assert "posttrain.rewards.format" in closure("grpo") & closure("dpo")
    assert "posttrain.training.health" in closure("grpo")
    assert not {
        m for m in closure("sft") | closure("data") | closure("eval") if m.startswith("posttrain.rewards")
    }
    assert "posttrain.evaluation.scoring" in closure("eval")
    assert not {m for m in closure("data") | closure("eval") if m.startswith("posttrain.training")}
    assert "posttrain.core.parsing" in closure("eval") & closure("grpo")  # the shared answer parser


def test_sft_really_calls_no_reward():
    """NOT_CALLED leaves rewards out of SFT's closure; that holds only while SFT never names them."""
    import ast

    tree = ast.parse((Path(posttrain.__file__).parent / "training" / "sft.py").read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not {n for n in names if "reward" in n.lower()}


@pytest.fixture
def package_copy(tmp_path):
    root = tmp_path / "posttrain"
    shutil.copytree(
        Path(posttrain.__file__).resolve().parent, root, ignore=shutil.ignore_patterns("__pycache__")
    )
    return root


def kind_files(kind: str, root: Path) -> dict[str, str]:
    return dict(code._kind_files.__wrapped__(kind, root))


@pytest.mark.parametrize(
    ("module", "affected"),
    [
        ("rewards/format.py", {"dpo", "grpo"}),  # a reward fix: the stages that score with rewards
        ("core/parsing.py", set(KINDS)),  # THE parser: GSM8K records, evaluation, rewards
        ("evaluation/scoring.py", {"eval"}),
        ("training/health.py", {"grpo"}),
        ("training/stage_run.py", {"sft", "dpo", "grpo"}),
        ("data/synthetic.py", set(KINDS)),  # synthetic problems: data, eval sets, stage data filters
        ("cli.py", set()),  # the command line is no step's code
    ],
)
def test_a_source_change_changes_exactly_the_kinds_that_run_it(module, affected, package_copy):
    before = {kind: kind_files(kind, package_copy) for kind in KINDS}
    target = package_copy / module
    target.write_text(target.read_text() + "\n_changed = True\n")
    after = {kind: kind_files(kind, package_copy) for kind in KINDS}
    assert {kind for kind in KINDS if before[kind] != after[kind]} == affected
    for kind in affected:
        assert CodeFingerprint(after[kind]).changed(before[kind]) == [f"posttrain/{module}"]


def test_docstrings_comments_and_layout_change_no_key(package_copy):
    """Mending the words of a module (the config model's field docs feed the generated reference)
    must not rerun the steps that import it; a changed string that is a value must."""
    before = {kind: kind_files(kind, package_copy) for kind in KINDS}
    config = package_copy / "core" / "config.py"
    source = config.read_text()
    assert '"""' in source and "# " in source
    reworded = (
        source.replace('"""', '"""Reworded. ', 1)  # the module's docstring
        .replace("    seed: int = Field(0", "    # a comment\n\n    seed: int = Field(\n        0", 1)
        .replace('    """', '    """Also reworded: ', 5)  # field and class docstrings
    )
    assert reworded != source
    config.write_text(reworded)
    assert {kind: kind_files(kind, package_copy) for kind in KINDS} == before
    config.write_text(
        source.replace('Literal["default", "small"] = "default"', 'Literal["default", "small"] = "small"', 1)
    )
    assert all(kind_files(kind, package_copy) != before[kind] for kind in KINDS)


def test_a_custom_rewards_source_is_part_of_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv(CUSTOM_CODE_ENV, "1")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = tmp_path / "my_reward_src.py"
    module.write_text("def reward(completions, **kw):\n    return [0.0] * len(completions)\n")
    first = code_fingerprint("grpo", ["my_reward_src:reward", "xml_count"])
    module.write_text("def reward(completions, **kw):\n    return [1.0] * len(completions)\n")
    second = code_fingerprint("grpo", ["my_reward_src:reward", "xml_count"])
    assert second.changed(first.files) == ["custom:my_reward_src"]
    assert first.digest != second.digest
    assert code_fingerprint("grpo").digest not in (first.digest, second.digest)


def test_the_keys_of_a_plan_include_the_code(smoke_config_path, monkeypatch):
    from posttrain.cache import keys
    from posttrain.core.results import DataResult
    from posttrain.pipeline import load_config
    from posttrain.pipeline.plan import StepInputs, build_plan
    from posttrain.pipeline.steps import ModelRef

    smoke = smoke_config_path
    plan = build_plan(load_config(smoke))
    inputs = StepInputs(ModelRef("/base", "fp"), DataResult("/d", "t", "e"))
    before = {s.name: s.key(plan.config, inputs) for s in plan.steps}
    real = keys.code_fingerprint

    def patched(kind, rewards=()):
        fp = real(kind, rewards)
        return CodeFingerprint({**fp.files, "posttrain/rewards/format.py": "x"}) if kind == "grpo" else fp

    monkeypatch.setattr(keys, "code_fingerprint", patched)
    after = {s.name: s.key(plan.config, inputs) for s in plan.steps}
    assert {n for n in before if before[n] != after[n]} == {"grpo-format", "grpo-correctness"}
    lineage = {s.name: s.identity(plan.config, inputs).lineage for s in plan.steps}
    monkeypatch.setattr(keys, "code_fingerprint", real)
    assert lineage == {s.name: s.identity(plan.config, inputs).lineage for s in plan.steps}
