"""No code from a config: custom `module:function` rewards need an opt-in from outside the config,
and validation never calls what a config names (it reads signatures, and imports only when opted in)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.core.config import parse_config
from posttrain.core.errors import ConfigError
from posttrain.rewards.registry import CUSTOM_CODE_ENV, CustomCodeRefused, build_reward, check_reward

CMDS = [
    ["validate", "CFG"],
    ["data", "preview", "CFG"],
    ["rewards", "check", "CFG"],
    ["run", "CFG", "--dry-run"],
]


@pytest.fixture(autouse=True)
def no_opt_in(monkeypatch):
    monkeypatch.delenv(CUSTOM_CODE_ENV, raising=False)


def shell_config(tmp_path: Path, planted: Path) -> Path:
    cfg = tmp_path / "evil.yaml"
    cfg.write_text(
        "name: evil\nmodel: {name: tiny-random}\n"
        f"orchestration: {{store: {tmp_path / 'store'}}}\n"
        "data: {source: synthetic, synthetic: {num_examples: 20}, eval_size: 4}\n"
        "grpo:\n  stages:\n    - name: s\n      rewards:\n"
        f'        - {{name: "os:system", params: {{command: "touch {planted}"}}}}\n'
    )
    return cfg


@pytest.mark.parametrize("cmd", CMDS, ids=lambda c: " ".join(c))
def test_os_system_reward_does_nothing_without_the_opt_in(cmd, tmp_path, capsys):
    planted = tmp_path / "pwned"
    cfg = shell_config(tmp_path, planted)
    assert main([str(cfg) if a == "CFG" else a for a in cmd]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{cfg}: grpo.stages.0.rewards.0: custom reward 'os:system'" in err
    assert "--allow-custom-code" in err
    assert not planted.exists()
    assert not (tmp_path / "store").exists()


def test_validation_with_the_opt_in_reads_the_signature_and_calls_nothing(tmp_path, capsys):
    planted = tmp_path / "pwned"
    cfg = shell_config(tmp_path, planted)
    assert main(["validate", str(cfg), "--allow-custom-code"]) == 0
    assert "ok" in capsys.readouterr().out
    assert not planted.exists()  # os.system(command) fits the factory signature, and is not called
    assert CUSTOM_CODE_ENV not in __import__("os").environ  # the flag does not outlive the command


def test_build_reward_refuses_custom_code_without_the_opt_in(tmp_path):
    planted = tmp_path / "pwned"
    with pytest.raises(CustomCodeRefused, match="--allow-custom-code"):
        build_reward("os:system", {"command": f"touch {planted}"})
    assert not planted.exists()


def test_a_custom_module_is_not_even_imported_without_the_opt_in(tmp_path, monkeypatch):
    import uuid

    module = f"sneaky_reward_{uuid.uuid4().hex}"  # a new name each time, even when rerun in one process
    planted = tmp_path / "imported"
    (tmp_path / f"{module}.py").write_text(
        f"open({str(planted)!r}, 'w').close()\ndef reward(completions, **kw):\n    return [0.0] * len(completions)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(CustomCodeRefused):
        check_reward(f"{module}:reward")
    assert not planted.exists() and module not in sys.modules

    monkeypatch.setenv(CUSTOM_CODE_ENV, "1")
    check_reward(f"{module}:reward")  # opted in: imported, signature fits
    assert planted.exists()
    del sys.modules[module]


@pytest.mark.parametrize(
    ("name", "params", "pattern"),
    [
        (
            "os:system",
            None,
            r"not a reward function f\(completions, \*\*kwargs\): it does not take \*\*kwargs",
        ),
        ("math:floor", None, r"does not take \*\*kwargs"),
        ("os:system", {"cmd": "x"}, r"unknown param\(s\) 'cmd'"),
        ("posttrain.rewards.shaping:make_length_reward", {"max_tokens": 3}, None),  # factory: fits
        ("posttrain.rewards.accuracy:correctness_reward", None, None),  # a reward: fits
    ],
)
def test_check_reward_with_the_opt_in_reads_signatures(name, params, pattern, monkeypatch):
    monkeypatch.setenv(CUSTOM_CODE_ENV, "1")
    if pattern is None:
        check_reward(name, params)
    else:
        with pytest.raises(ValueError, match=pattern):
            check_reward(name, params)


def test_the_flow_refuses_a_config_from_deployment_parameters(tmp_path):
    """A deployment's parameters skip the CLI: the flow checks rewards itself, before the store."""
    from posttrain.flows.pipeline_flow import posttrain_pipeline

    planted = tmp_path / "pwned"
    cfg = parse_config(
        {
            "name": "evil",
            "model": {"name": "tiny-random"},
            "orchestration": {"store": str(tmp_path / "store")},
            "grpo": {
                "stages": [
                    {
                        "name": "s",
                        "rewards": [{"name": "os:system", "params": {"command": f"touch {planted}"}}],
                    }
                ]
            },
        }
    )
    with pytest.raises(ConfigError, match="--allow-custom-code"):
        posttrain_pipeline.fn(cfg)
    assert not planted.exists() and not (tmp_path / "store").exists()
