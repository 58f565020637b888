"""`launch.launcher`: the shipped accelerate configs, the launch command, how the launcher enters the
cache key, and what fails before anything starts. The 2-process runs are in test_launcher_multiprocess.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.core.config import LaunchConfig, PipelineConfig
from posttrain.core.errors import ConfigError, HardwareError
from posttrain.core.results import DataResult
from posttrain.models.hardware import cuda_available
from posttrain.pipeline.launcher import (
    CPU_ACCELERATE_CONFIG,
    STAGE_MODULE,
    accelerate_setup,
    launch_command,
    launch_stage,
)
from posttrain.pipeline.plan import StepInputs, build_plan
from posttrain.pipeline.steps import ModelRef

REPO = Path(__file__).resolve().parents[2]
ACCELERATE_CONFIGS = sorted((REPO / "configs" / "accelerate").glob("*.yaml"))
# (file, accelerate's distributed type, needs CUDA)
SHIPPED = [
    ("cpu.yaml", "MULTI_GPU", False),  # torchrun launcher, MULTI_CPU/gloo inside (see the file)
    ("ddp.yaml", "MULTI_GPU", True),
    ("fsdp2.yaml", "FSDP", True),
    ("single_gpu.yaml", "NO", False),  # one process: runs anywhere
    ("zero2.yaml", "DEEPSPEED", True),
    ("zero3.yaml", "DEEPSPEED", True),
]


def test_every_accelerate_config_is_in_the_table():
    assert [p.name for p in ACCELERATE_CONFIGS] == [name for name, _, _ in SHIPPED]


@pytest.mark.parametrize(("name", "kind", "needs_cuda"), SHIPPED, ids=[s[0] for s in SHIPPED])
def test_shipped_accelerate_configs_load_with_accelerates_own_loader(name, kind, needs_cuda, monkeypatch):
    """accelerate's loader builds its config dataclass from the file: an unknown key is a TypeError,
    an unknown distributed type or precision a ValueError."""
    from accelerate.commands.config.config_args import load_config_from_file

    path = REPO / "configs" / "accelerate" / name
    loaded = load_config_from_file(str(path))
    assert str(loaded.distributed_type).split(".")[-1] == kind
    assert loaded.compute_environment.value == "LOCAL_MACHINE" and loaded.num_machines == 1
    if kind == "FSDP":
        assert loaded.fsdp_config["fsdp_version"] == 2
    if kind == "DEEPSPEED":
        assert loaded.deepspeed_config["zero_stage"] == int(name[4])
    monkeypatch.chdir(REPO)
    setup = accelerate_setup(
        LaunchConfig(launcher="accelerate", accelerate_config=f"configs/accelerate/{name}")
    )
    assert setup.needs_cuda is needs_cuda and setup.num_processes == loaded.num_processes
    assert setup.shards == {"fsdp2.yaml": "FSDP", "zero3.yaml": "DeepSpeed ZeRO-3"}.get(name)


@pytest.mark.parametrize(
    "json_text, shards",
    [
        ('{"zero_optimization": {"stage": 3}}', "DeepSpeed ZeRO-3"),
        ('{"zero_optimization": {"stage": 2}}', None),
        ("not json", None),  # unknown here: the trainer checks once DeepSpeed has read it
        ('["a list"]', None),
    ],
    ids=["stage-3", "stage-2", "not-json", "not-an-object"],
)
def test_a_deepspeed_json_file_says_whether_the_policy_is_sharded(tmp_path, json_text, shards):
    """accelerate files may name DeepSpeed's own JSON instead of a ``zero_stage``."""
    (tmp_path / "ds.json").write_text(json_text)
    config = tmp_path / "acc.yaml"
    config.write_text(
        "distributed_type: DEEPSPEED\nnum_processes: 2\n"
        f"deepspeed_config:\n  deepspeed_config_file: {tmp_path / 'ds.json'}\n"
    )
    setup = accelerate_setup(LaunchConfig(launcher="accelerate", accelerate_config=str(config)))
    assert setup.shards == shards


def test_the_cpu_config_runs_two_processes_on_loopback():
    from accelerate.commands.config.config_args import load_config_from_file

    loaded = load_config_from_file(str(REPO / CPU_ACCELERATE_CONFIG))
    assert loaded.use_cpu and loaded.num_processes == 2 and loaded.main_process_ip == "127.0.0.1"


def test_the_launch_command_takes_a_free_port_unless_the_file_names_one(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    launch = LaunchConfig(launcher="accelerate", accelerate_config=CPU_ACCELERATE_CONFIG, num_processes=3)
    cmd = launch_command(accelerate_setup(launch), tmp_path / "r.json")
    assert cmd[1:3] == ["-m", "accelerate.commands.launch"]
    assert cmd[cmd.index("--config_file") + 1] == CPU_ACCELERATE_CONFIG
    assert cmd[cmd.index("--num_processes") + 1] == "3"  # launch.num_processes wins over the file's 2
    assert cmd[cmd.index("--main_process_port") + 1] == "0"
    assert cmd[-3:] == ["-m", STAGE_MODULE, str(tmp_path / "r.json")]
    own_port = tmp_path / "port.yaml"
    own_port.write_text((REPO / CPU_ACCELERATE_CONFIG).read_text() + "main_process_port: 29555\n")
    cmd = launch_command(
        accelerate_setup(launch.model_copy(update={"accelerate_config": str(own_port)})), "r"
    )
    assert "--main_process_port" not in cmd


@pytest.mark.parametrize("name", ["fsdp2.yaml", "zero3.yaml"])
def test_sharding_on_a_cpu_is_refused_not_run_as_ddp(name, tmp_path, monkeypatch):
    """accelerate 1.x picks MULTI_CPU (DDP) for a CPU run whatever the file's FSDP or DeepSpeed
    settings (its state.py turns them on without ``cpu`` only): an FSDP2 file with use_cpu: true
    would train 2 processes as DDP (its reducer's warning shows it in the log)."""
    monkeypatch.chdir(REPO)
    on_cpu = tmp_path / f"cpu-{name}"
    on_cpu.write_text(
        (REPO / "configs/accelerate" / name).read_text().replace("use_cpu: false", "use_cpu: true")
    )
    with pytest.raises(ConfigError, match=rf"^launch.accelerate_config: .*cpu-{name}: distributed_type "):
        accelerate_setup(LaunchConfig(launcher="accelerate", accelerate_config=str(on_cpu)))


def test_without_an_accelerate_config_the_machine_picks_one(monkeypatch):
    monkeypatch.chdir(REPO)
    setup = accelerate_setup(LaunchConfig(launcher="accelerate"))
    expected = "configs/accelerate/ddp.yaml" if cuda_available() else CPU_ACCELERATE_CONFIG
    assert setup.config_file == expected


def test_a_missing_accelerate_config_names_the_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError, match=r"^sft.launch.accelerate_config: no such accelerate config: x.yaml"
    ):
        accelerate_setup(LaunchConfig(accelerate_config="x.yaml"), "sft.launch.accelerate_config")


def cfg_with(launch: dict | None = None, sft_launch: dict | None = None) -> PipelineConfig:
    raw = {
        "name": "t",
        "model": {"name": "tiny-random"},
        "sft": {"trainer": {"max_steps": 1}, **({"launch": sft_launch} if sft_launch else {})},
        **({"launch": launch} if launch else {}),
    }
    return PipelineConfig.model_validate(raw)


def sft_key(cfg: PipelineConfig) -> str:
    inputs = StepInputs(ModelRef("m", "model-fp"), DataResult("d", "data-fp", "e"))
    return build_plan(cfg).step("sft").key(cfg, inputs)


def test_one_process_keeps_the_key_and_more_processes_change_it(monkeypatch):
    """The in-process key is the key of before launchers existed (no cached stage is lost); the
    number of processes multiplies the global batch, so it is part of the key."""
    monkeypatch.chdir(REPO)
    plain = sft_key(cfg_with())
    assert sft_key(cfg_with({"launcher": "inprocess", "num_processes": 4})) == plain
    assert sft_key(cfg_with(sft_launch={"launcher": "inprocess"})) == plain
    assert sft_key(cfg_with({"launcher": "accelerate", "num_processes": 1})) == plain
    two = sft_key(cfg_with({"launcher": "accelerate", "accelerate_config": CPU_ACCELERATE_CONFIG}))
    assert two != plain
    # The same world size, however it is spelt, is the same key.
    assert sft_key(cfg_with(sft_launch={"launcher": "accelerate", "num_processes": 2})) == two
    assert sft_key(cfg_with({"launcher": "accelerate", "num_processes": 3})) not in (plain, two)


def test_a_stage_overrides_the_global_launcher():
    cfg = cfg_with({"launcher": "accelerate", "num_processes": 2}, sft_launch={"launcher": "inprocess"})
    assert cfg.launch_of(cfg.sft) == LaunchConfig(launcher="inprocess", num_processes=2)
    assert cfg.launch_of(cfg.dpo) == LaunchConfig(launcher="accelerate", num_processes=2)
    assert "launch" not in cfg_with().sft.model_dump(mode="json")  # unset: not in the stage's hash


@pytest.mark.parametrize("stage_lora", [None, "grpo.stages.1.lora=null", "sft.lora={r: 4}"])
def test_a_launched_child_rebuilds_the_same_config(smoke_config_path, stage_lora):
    """The child of `accelerate launch` validates the request's config again: it must train exactly
    what the parent planned, down to a stage's unset `lora:` (follow model.lora) vs an explicit null."""
    import json

    from posttrain.pipeline import load_config
    from posttrain.pipeline.launcher import _request

    cfg = load_config(smoke_config_path, [stage_lora] if stage_lora else [])
    inputs = StepInputs(ModelRef(path="m", fingerprint="f"), None)
    sent = json.loads(json.dumps(_request(cfg, "sft", inputs, "out"), default=str))
    child = PipelineConfig.model_validate(sent["config"])
    assert child == cfg
    twins = dict(child.stage_sections())
    for key, section in cfg.stage_sections():
        assert child.model_for(twins[key]) == cfg.model_for(section), key


@pytest.mark.skipif(cuda_available(), reason="checks the message on a machine without CUDA")
def test_a_gpu_accelerate_config_on_a_cpu_fails_in_one_line_before_launching(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = cfg_with({"launcher": "accelerate", "accelerate_config": "configs/accelerate/fsdp2.yaml"})
    inputs = StepInputs(ModelRef("m", "fp"), DataResult(str(tmp_path), "a", "b"))
    with pytest.raises(HardwareError) as err:
        launch_stage(cfg, "sft", "sft", cfg.sft, inputs, str(tmp_path / "out"))
    assert str(err.value).count("\n") == 0
    assert "configs/accelerate/fsdp2.yaml needs CUDA GPUs" in str(err.value)
    assert not (tmp_path / "out").exists()


def test_a_launched_stage_process_keeps_library_warnings_off_the_terminal(tmp_path, monkeypatch):
    """Each rank of each stage is a process of its own: without the CLI's filters it would print
    transformers' deprecations (TRL's calls trigger them) once per rank and stage."""
    import warnings

    from posttrain.pipeline import stage_main

    def deprecated_call(request):
        warnings.warn_explicit(
            "old", FutureWarning, "modeling_utils.py", 1, module="transformers.modeling_utils"
        )
        warnings.warn_explicit("ours", UserWarning, "x.py", 1, module="posttrain.x")

    monkeypatch.setattr(stage_main, "run_request", deprecated_call)
    monkeypatch.setattr(stage_main.logging, "basicConfig", lambda **kwargs: None)
    (tmp_path / "r.json").write_text("{}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert stage_main.main([str(tmp_path / "r.json")]) == 0
    assert [str(w.message) for w in caught] == ["ours"]


@pytest.mark.parametrize("rank", [0, 1])
def test_only_rank_0_of_a_launched_stage_draws_progress_bars(tmp_path, monkeypatch, rank):
    import datasets
    import transformers

    from posttrain.pipeline import stage_main

    seen = []
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setattr(
        stage_main,
        "run_request",
        lambda request: seen.append(
            (datasets.is_progress_bar_enabled(), transformers.utils.logging.is_progress_bar_enabled())
        ),
    )
    monkeypatch.setattr(stage_main.logging, "basicConfig", lambda **kwargs: None)
    (tmp_path / "r.json").write_text("{}")
    datasets.enable_progress_bars()  # as a fresh process starts, whatever an earlier test left
    transformers.utils.logging.enable_progress_bar()
    try:
        assert stage_main.main([str(tmp_path / "r.json")]) == 0
    finally:
        datasets.enable_progress_bars()
        transformers.utils.logging.enable_progress_bar()
    assert seen == [(rank == 0, rank == 0)]
