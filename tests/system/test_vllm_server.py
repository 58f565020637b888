"""The managed vLLM server (posttrain.generation.vllm_server) against a stand-in: a stdlib HTTP server
that answers /health like vLLM's and forks a child, as vLLM's engine does, so stopping the whole
process group is checked too. No GPU, no vLLM, no TRL server."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from posttrain.core.config import GRPOStageConfig, ModelConfig, VLLMServerConfig, parse_config
from posttrain.core.errors import ConfigError, StageError
from posttrain.core.net import free_port
from posttrain.generation.vllm_server import HEALTH_PATH, ServerAddress, serve_command, vllm_server
from posttrain.pipeline.validation import check_vllm_server, managed_vllm_stages

FAKE_SERVER = textwrap.dedent(
    """
    import http.server, json, subprocess, sys, time
    port, pids, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    replies, requests = (sys.argv[4], sys.argv[5]) if len(sys.argv) > 5 else (None, None)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # an engine process
    with open(pids, "w") as fh:
        fh.write(f"{child.pid}\\n")
    print("loading model weights", flush=True)
    print("VLLM_SERVER_DEV_MODE=" + str(__import__("os").environ.get("VLLM_SERVER_DEV_MODE")), flush=True)
    if mode == "crash":
        print("torch.OutOfMemoryError: CUDA out of memory", flush=True)
        sys.exit(3)
    if mode == "hang":  # never listens: what a server stuck in start-up looks like
        time.sleep(600)

    def complete(body):
        # vLLM's /v1/completions as TRL's client reads it: sample j of every prompt is reply j (token
        # ids from the test), cut at max_tokens; choices come back out of order (only `index` says).
        fixed = json.load(open(replies))
        choices = []
        for i, _ in enumerate(body["prompt"]):
            for j in range(body["n"]):
                ids = fixed[j % len(fixed)]
                cut = ids[: body["max_tokens"]]
                reason = "length" if len(cut) < len(ids) else "stop"
                choices.append({"index": i * body["n"] + j, "token_ids": cut, "finish_reason": reason})
        return {"choices": choices[::-1]}

    class Handler(http.server.BaseHTTPRequestHandler):
        def answer(self, code, payload=None):
            data = json.dumps(payload).encode() if payload is not None else b""
            self.send_response(code)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health":
                self.answer(200)
            elif self.path == "/v1/models" and replies:
                self.answer(200, {"data": [{"id": "served-model"}]})
            else:
                self.answer(404)

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path != "/v1/completions" or not replies:
                return self.answer(404)
            with open(requests, "a") as fh:
                fh.write(json.dumps(body) + "\\n")
            self.answer(200, complete(body))

        def log_message(self, *args):
            pass

    http.server.HTTPServer(("127.0.0.1", port), Handler).serve_forever()
    """
)


@pytest.fixture
def fake(tmp_path):
    """(config, command factory, path of the file the fake writes its child's pid to)."""
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_SERVER)
    pids = tmp_path / "pids"
    cfg = VLLMServerConfig(gpus=[1], port=free_port(), timeout_s=60)

    def command(mode: str = "serve", replies: list[list[int]] | None = None) -> list[str]:
        """The stand-in's command line; with ``replies`` it also answers /v1/completions with them
        and appends each request's JSON body to ``tmp_path/requests.jsonl``."""
        cmd = [sys.executable, str(script), str(cfg.port), str(pids), mode]
        if replies is not None:
            (tmp_path / "replies.json").write_text(json.dumps(replies))
            cmd += [str(tmp_path / "replies.json"), str(tmp_path / "requests.jsonl")]
        return cmd

    return cfg, command, pids


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie no reaper collected counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def gone(pid: int) -> bool:
    """Wait (bounded) for a killed process to disappear: the signal is delivered asynchronously."""
    for _ in range(200):
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def health(address: ServerAddress) -> int:
    with urllib.request.urlopen(f"{address.base_url}{HEALTH_PATH}", timeout=5) as response:
        return response.status


def test_the_server_is_healthy_inside_the_block_and_its_whole_group_is_stopped_after(fake, tmp_path):
    cfg, command, pids = fake
    log = tmp_path / "logs" / "vllm_server.log"
    with vllm_server(cfg, "some/model", log, command=command()) as address:
        assert address == ServerAddress("127.0.0.1", cfg.port)
        assert health(address) == 200  # healthy on entry: no waiting here
        child = int(pids.read_text())
        assert alive(child)
    assert gone(child)  # the engine-like child, not just the leader
    with pytest.raises(OSError):
        health(address)
    assert "loading model weights" in log.read_text()


def test_the_server_is_stopped_when_the_block_raises(fake, tmp_path):
    cfg, command, pids = fake
    with (
        pytest.raises(RuntimeError, match="training failed"),
        vllm_server(cfg, "m", tmp_path / "log", command=command()),
    ):
        child = int(pids.read_text())
        raise RuntimeError("training failed")
    assert gone(child)
    with pytest.raises(OSError):
        health(ServerAddress(cfg.host, cfg.port))


def test_a_server_that_exits_early_is_one_line_with_its_log_tail(fake, tmp_path):
    cfg, command, pids = fake
    with pytest.raises(StageError) as err, vllm_server(cfg, "m", tmp_path / "log", command=command("crash")):
        pytest.fail("the block must not run")
    message = str(err.value)
    assert "\n" not in message
    assert "exited with code 3" in message and "CUDA out of memory" in message and "loading model" in message
    assert gone(int(pids.read_text()))


def test_a_server_that_never_answers_times_out_and_is_killed(fake, tmp_path, monkeypatch):
    import posttrain.generation.vllm_server as module

    cfg, command, _ = fake
    cfg = cfg.model_copy(update={"timeout_s": 1.0})
    started, real_popen = [], subprocess.Popen

    def popen(*args, **kwargs):  # the server process itself: its pid file may not exist yet after 1 s
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(module.subprocess, "Popen", popen)
    with (
        pytest.raises(StageError, match=r"within 1 s \(vllm_server.timeout_s\), stopped it; last lines of "),
        vllm_server(cfg, "m", tmp_path / "log", command=command("hang"), grace_s=1),
    ):
        pytest.fail("the block must not run")
    assert started[0].returncode is not None  # stopped and reaped


def test_a_port_already_in_use_is_refused_before_starting(fake, tmp_path):
    cfg, command, pids = fake
    with socket.socket() as other:
        other.bind(("127.0.0.1", cfg.port))
        other.listen()
        with (
            pytest.raises(StageError, match="already listens on 127.0.0.1:"),
            vllm_server(cfg, "m", tmp_path / "log", command=command()),
        ):
            pytest.fail("the block must not run")
    assert not pids.exists()  # nothing was started


def test_serve_command_is_vllm_serve_with_trls_flags_and_posttrains_address(monkeypatch):
    monkeypatch.setenv("POSTTRAIN_ALLOW_CUSTOM_CODE", "1")  # --max-num-seqs is off the allow list
    cfg = VLLMServerConfig(
        gpus=[2, 3],
        host="127.0.0.1",
        port=8123,
        extra_args=["--data_parallel_size", "2", "--enforce_eager", "--max-num-seqs", "64"],
    )
    cmd = serve_command(cfg, "/models/base", revision="abc")
    # vLLM's own CLI, not TRL's deprecated wrapper, with this interpreter
    assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "/models/base"]
    assert "vllm-serve" not in cmd and "trl.cli.main" not in cmd

    def value(flag):
        return cmd[cmd.index(flag) + 1]

    assert (value("--host"), value("--port"), value("--revision")) == ("127.0.0.1", "8123", "abc")
    # data parallel from extra_args, so no tensor parallel over the two GPUs
    assert (value("--data-parallel-size"), value("--tensor-parallel-size")) == ("2", "1")
    assert "--enforce-eager" in cmd
    # what TRL's trainers need from the server (TRL's build_command adds it)
    assert value("--weight-transfer-config") == '{"backend": "nccl"}'
    assert value("--logprobs-mode") == "processed_logprobs"
    # a flag trl vllm-serve does not know is forwarded to vllm serve as written
    assert cmd[-2:] == ["--max-num-seqs", "64"]


def test_two_gpus_without_a_parallel_flag_serve_tensor_parallel():
    cmd = serve_command(VLLMServerConfig(gpus=[0, 1], port=8124), "m")
    assert cmd[cmd.index("--tensor-parallel-size") + 1] == "2"


def test_the_server_runs_in_vllms_dev_mode(fake, tmp_path):
    cfg, command, pids = fake
    with vllm_server(cfg, "m", tmp_path / "log", command=command()):
        pass
    # the fake server writes its environment's VLLM_SERVER_DEV_MODE into the log
    assert "VLLM_SERVER_DEV_MODE=1" in (tmp_path / "log").read_text()


# --------------------------------------------------------------------------- the GRPO stage

STAGE = {
    "name": "s",
    "rewards": [{"name": "xml_count"}],
    "trainer": {
        "max_steps": 1,
        "num_generations": 2,
        "per_device_train_batch_size": 2,
        "use_vllm": True,
        "vllm_mode": "server",
    },
}


def test_the_grpo_trainer_options_point_at_the_server_and_stay_out_of_the_cache_key(tmp_path):
    from trl import GRPOConfig

    from posttrain.training.grpo import grpo_arguments, grpo_options
    from posttrain.training.stage_run import StageContext

    stage = GRPOStageConfig.model_validate(STAGE)
    ctx = StageContext(stage="grpo-s", work_dir=tmp_path, precision="fp32", seed=0, report_to="none")
    args = GRPOConfig(**grpo_arguments(stage, ctx, ServerAddress("127.0.0.1", 8123)))
    assert (args.use_vllm, args.vllm_mode) == (True, "server")
    assert (args.vllm_server_host, args.vllm_server_port, args.vllm_server_base_url) == (
        "127.0.0.1",
        8123,
        None,
    )
    assert "vllm_server_port" not in grpo_options(stage)  # hashed into the stage's key and stage.json


def test_a_grpo_stage_in_server_mode_trains_inside_the_server_and_stops_it(
    fake, tmp_path, tiny_model_dir, monkeypatch
):
    """run_grpo_stage's wiring, with the trainer replaced: the server is healthy when the trainer is
    built, the trainer gets its address, and a failing stage still stops it."""
    import posttrain.training.grpo as grpo
    import posttrain.training.stage_run as runner

    cfg, command, pids = fake
    monkeypatch.setattr(runner, "check_hardware", lambda *a, **k: None)  # CUDA and vLLM, on this CPU
    seen = {}

    def trainer_that_fails(*args, server=None, **kwargs):
        seen["server"], seen["status"] = server, health(server)
        seen["child"] = int(pids.read_text())
        raise RuntimeError("CUDA error mid-stage")

    monkeypatch.setattr(grpo, "make_grpo_trainer", trainer_that_fails)
    stage = GRPOStageConfig.model_validate(STAGE)
    model = ModelConfig(name=str(tiny_model_dir), precision="fp32")
    with pytest.raises(RuntimeError, match="CUDA error mid-stage"):
        grpo.run_grpo_stage(
            stage,
            model,
            tiny_model_dir,
            [{"prompt": "q"}],
            tmp_path / "out",
            vllm_server_cfg=cfg,
            server_command=command(),
        )
    assert seen["server"] == ServerAddress("127.0.0.1", cfg.port) and seen["status"] == 200
    assert gone(seen["child"])


def test_only_server_mode_stages_of_a_config_with_the_section_get_a_managed_server():
    colocate = {**STAGE, "name": "c", "trainer": {**STAGE["trainer"], "vllm_mode": "colocate"}}
    stages = {"stages": [colocate, STAGE]}
    assert managed_vllm_stages(parse_config({**BASE, "grpo": stages})) == [1]
    assert managed_vllm_stages(parse_config({**BASE, "vllm_server": None, "grpo": stages})) == []


# --------------------------------------------------------------------------- config

BASE = {"name": "x", "model": {"name": "m"}, "grpo": {"stages": [STAGE]}, "vllm_server": {"gpus": [1]}}


def with_trainer(**options) -> dict:
    stage = {**STAGE, "trainer": {**STAGE["trainer"], **options}}
    return {**BASE, "grpo": {"stages": [stage]}}


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (with_trainer(vllm_server_port=9000), "grpo.stages.0.trainer.vllm_server_port: 9000 conflicts"),
        (with_trainer(vllm_server_host="10.0.0.2"), "grpo.stages.0.trainer.vllm_server_host: '10.0.0.2'"),
        (with_trainer(vllm_server_base_url="http://h:1"), "grpo.stages.0.trainer.vllm_server_base_url"),
        (
            {**BASE, "vllm_server": {"gpus": [1], "extra_args": ["--port=9"]}},
            "vllm_server.extra_args: --port is set by posttrain",
        ),
        (
            {**BASE, "vllm_server": {"gpus": [1, 1]}},
            "vllm_server.gpus: GPU indices must be distinct",
        ),  # a GPU twice
        ({**BASE, "vllm_server": {"gpus": []}}, "vllm_server.gpus: List should have at least 1"),
    ],
)
def test_bad_vllm_server_configs_name_the_key(raw, fragment):
    with pytest.raises(ConfigError, match="^cfg.yaml: ") as err:
        check_vllm_server(parse_config(raw, "cfg.yaml"), "cfg.yaml")
    assert fragment in str(err.value)


def test_the_same_host_and_port_in_the_trainer_are_accepted():
    cfg = parse_config(with_trainer(vllm_server_host="127.0.0.1", vllm_server_port=8000), "cfg.yaml")
    check_vllm_server(cfg, "cfg.yaml")
    assert managed_vllm_stages(cfg) == [0]


# --------------------------------------------------------------------------- evaluation through the server

QUESTIONS = [("What is 40 plus 2?", 42), ("What is 5 plus 2?", 7), ("What is 21 times 2?", 42)]


def eval_config(tiny_model_dir, tmp_path, port: int, **eval_options):
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": f"#### {a}"}) + "\n" for q, a in QUESTIONS))
    eval_cfg = {"data": "local", "path": str(data), "backend": "vllm_server", "max_completion_length": 64}
    return parse_config(
        {
            "name": "x",
            "model": {"name": str(tiny_model_dir), "precision": "fp32"},
            "eval": {**eval_cfg, **eval_options},
            "vllm_server": {"gpus": [1], "port": port, "timeout_s": 60},
        }
    )


def requests_sent(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    ("max_completion_length", "truncated"),
    [
        (64, False),  # the whole reply, ending in EOS
        (3, True),  # cut by eval.max_completion_length: the server must be asked for 3 tokens
    ],
)
def test_eval_step_generates_through_the_server_and_stops_it(
    fake, tmp_path, tiny_model_dir, tiny_tokenizer, max_completion_length, truncated
):
    from posttrain.evaluation.report import EvalReport
    from posttrain.pipeline.steps import ModelRef, eval_step

    server_cfg, command, pids = fake
    reply = [
        *tiny_tokenizer("The answer is 42.", add_special_tokens=False)["input_ids"],
        tiny_tokenizer.eos_token_id,
    ]
    cfg = eval_config(tiny_model_dir, tmp_path, server_cfg.port, max_completion_length=max_completion_length)
    out = tmp_path / "eval-baseline"
    result = eval_step(
        cfg,
        "baseline",
        ModelRef(str(tiny_model_dir), "f"),
        None,
        out,
        server_command=command(replies=[reply]),
    )
    child = int(pids.read_text())
    assert gone(child)
    with pytest.raises(OSError):
        health(ServerAddress(server_cfg.host, server_cfg.port))

    expected = tiny_tokenizer.decode(reply[:max_completion_length], skip_special_tokens=True)
    report = EvalReport.load(out)
    assert [r.completion for r in report.records] == [expected] * 3
    assert [r.truncated for r in report.records] == [truncated] * 3
    assert [r.tokens for r in report.records] == [min(len(reply), max_completion_length)] * 3
    assert [r.correct_flexible for r in report.records] == ([False] * 3 if truncated else [True, False, True])
    assert result.summary["accuracy_flexible"] == pytest.approx(0 if truncated else 2 / 3)
    assert "loading model weights" in (out / "vllm_server.log").read_text()
    assert not [p for p in out.iterdir() if p.name.startswith("served-")]  # no scratch folder left

    [body] = requests_sent(tmp_path)  # one request, the hf backend's sampling settings
    assert (body["model"], body["n"], body["temperature"], body["max_tokens"]) == (
        "served-model",
        1,
        0.0,
        max_completion_length,
    )
    assert tiny_tokenizer.eos_token_id in body["stop_token_ids"] and body["return_token_ids"] is True
    prompts = [tiny_tokenizer.decode(p) for p in body["prompt"]]
    assert [q in p for (q, _), p in zip(QUESTIONS, prompts, strict=True)] == [True] * 3


def test_samples_come_back_per_prompt_in_order(fake, tmp_path, tiny_model_dir, tiny_tokenizer):
    """pass@k through the server: n samples per prompt, sample j of each prompt where it belongs."""
    from posttrain.core.config import EvalConfig
    from posttrain.evaluation import evaluate

    server_cfg, command, _ = fake
    words = ["The answer is 42.", "It is 7."]
    replies = [tiny_tokenizer(w, add_special_tokens=False)["input_ids"] for w in words]
    records = [{"id": str(i), "question": q, "answer": str(a)} for i, (q, a) in enumerate(QUESTIONS)]
    cfg = EvalConfig(backend="vllm_server", pass_k=2, temperature=0.7, seed=5, max_completion_length=32)
    with vllm_server(server_cfg, "m", tmp_path / "log", command=command(replies=replies)) as address:
        report = evaluate(str(tiny_model_dir), records, cfg, server=address)
    assert [[s.completion for s in r.samples] for r in report.records] == [words] * 3
    assert [r.num_correct_flexible for r in report.records] == [1, 1, 1]
    [body] = requests_sent(tmp_path)
    assert (body["n"], body["temperature"], body["seed"]) == (2, 0.7, 5)


def test_the_server_is_stopped_when_scoring_fails(
    fake, tmp_path, tiny_model_dir, tiny_tokenizer, monkeypatch
):
    import posttrain.evaluation.evaluator as evaluator
    from posttrain.pipeline.steps import ModelRef, eval_step

    def broken(*args, **kwargs):
        raise RuntimeError("scoring failed")

    monkeypatch.setattr(evaluator, "score_completion", broken)
    server_cfg, command, pids = fake
    cfg = eval_config(tiny_model_dir, tmp_path, server_cfg.port)
    out = tmp_path / "eval-baseline"
    with pytest.raises(RuntimeError, match="scoring failed"):
        eval_step(
            cfg,
            "baseline",
            ModelRef(str(tiny_model_dir), "f"),
            None,
            out,
            server_command=command(replies=[[1]]),
        )
    assert requests_sent(tmp_path)  # it did generate through the server before scoring
    assert gone(int(pids.read_text()))
    with pytest.raises(OSError):
        health(ServerAddress(server_cfg.host, server_cfg.port))
    assert not out.exists()


def test_eval_through_the_server_fails_in_one_line_on_a_cpu_before_loading(
    tmp_path, tiny_model_dir, monkeypatch
):
    import posttrain.evaluation.served as served
    import posttrain.generation.vllm_server as module
    from posttrain.core.errors import HardwareError
    from posttrain.pipeline.steps import ModelRef, eval_step

    monkeypatch.setattr(module, "cuda_available", lambda: False)
    monkeypatch.setattr(served, "servable_model", lambda *a: pytest.fail("loaded a model"))
    cfg = eval_config(tiny_model_dir, tmp_path, free_port())
    out = tmp_path / "eval-baseline"
    with pytest.raises(HardwareError, match="^vllm_server: a managed vLLM server needs a CUDA GPU") as err:
        eval_step(cfg, "baseline", ModelRef(str(tiny_model_dir), "f"), None, out)
    assert "\n" not in str(err.value) and not out.exists()


def test_eval_backend_vllm_server_without_the_section_is_a_config_error(tmp_path):
    from posttrain.cli import main

    raw = {"name": "x", "model": {"name": "m"}, "eval": {"backend": "vllm_server"}}
    with pytest.raises(ConfigError) as err:
        check_vllm_server(parse_config(raw, "cfg.yaml"), "cfg.yaml")
    assert str(err.value).startswith("cfg.yaml: eval.backend: vllm_server needs a vllm_server: section")
    assert "\n" not in str(err.value)
    path = tmp_path / "cfg.yaml"
    path.write_text(json.dumps(raw))  # JSON is YAML
    assert main(["validate", str(path)]) == 2


# --------------------------------------------------------------------------- TRL's weight-sync group port


def test_managed_stages_get_a_free_group_port_unless_they_set_one(tmp_path):
    from trl import GRPOConfig

    from posttrain.training.grpo import grpo_arguments
    from posttrain.training.stage_run import StageContext

    ctx = StageContext(stage="grpo-s", work_dir=tmp_path, precision="fp32", seed=0, report_to="none")
    server = ServerAddress("127.0.0.1", 8123)
    stage = GRPOStageConfig.model_validate(STAGE)
    ports = [GRPOConfig(**grpo_arguments(stage, ctx, server)).vllm_group_port for _ in range(2)]
    assert 51216 not in ports and ports[0] != ports[1]  # two stages (or runs) on one machine
    own = GRPOStageConfig.model_validate({**STAGE, "trainer": {**STAGE["trainer"], "vllm_group_port": 51216}})
    assert GRPOConfig(**grpo_arguments(own, ctx, server)).vllm_group_port == 51216  # the user's choice
    assert "vllm_group_port" not in grpo_arguments(stage, ctx)  # no managed server: TRL's own default


def _adapter_output(tmp_path: Path, base: Path):
    """A LoRA adapter output of ``base`` whose update is not zero, and its policy (for logits)."""
    from peft import get_peft_model

    from posttrain.core.config import LoraConfig
    from posttrain.models import artifacts
    from posttrain.models.loading import build_peft_config, load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(str(base), "fp32", for_training=True)
    policy = get_peft_model(model, build_peft_config(LoraConfig(r=4, alpha=8)))
    for name, param in policy.named_parameters():
        if "lora_B" in name:
            param.data.fill_(0.01)
    policy.eval()
    adapter = tmp_path / "adapter"
    assert artifacts.save_policy(policy, tokenizer, adapter, adapter_policy="adapter") == "adapter"
    (adapter / "stage.json").write_text(json.dumps({"adapter": {"base": str(base)}}))
    return adapter, policy


def test_an_adapter_output_is_served_merged_from_a_scratch_folder(fake, tmp_path, tiny_model_dir):
    """The server loads the evaluated weights: for an adapter output the chain merged onto its base
    (not the base alone, as a GRPO stage's server may), in a folder that goes away with the server."""
    import torch
    from transformers import AutoModelForCausalLM

    from posttrain.evaluation.served import eval_server
    from posttrain.models import artifacts

    adapter, policy = _adapter_output(tmp_path, tiny_model_dir)
    server_cfg, command, _ = fake
    ids = torch.tensor([[5, 6, 7, 8]])
    model_cfg = ModelConfig(name=str(tiny_model_dir), precision="fp32")
    with eval_server(server_cfg, model_cfg, str(adapter), tmp_path / "work", command=command()) as (
        _,
        served,
    ):
        assert not artifacts.is_adapter_dir(served) and served != str(tiny_model_dir)
        with torch.no_grad():
            merged = AutoModelForCausalLM.from_pretrained(served, dtype=torch.float32)
            assert torch.allclose(merged(input_ids=ids).logits, policy(input_ids=ids).logits, atol=1e-5)
    assert not Path(served).exists()
    with eval_server(server_cfg, model_cfg, str(tiny_model_dir), tmp_path / "work", command=command()) as (
        _,
        s,
    ):
        assert s == str(tiny_model_dir)  # a full model is served from its own folder


def test_a_served_adapter_is_merged_in_the_evaluated_precision_beside_its_tokenizer(
    fake, tmp_path, tiny_model_dir, tiny_tokenizer, caplog
):
    from transformers import AutoTokenizer

    from posttrain.evaluation.served import eval_server

    adapter, _ = _adapter_output(tmp_path, tiny_model_dir)
    server_cfg, command, _ = fake
    model_cfg = ModelConfig(name=str(tiny_model_dir), precision="bf16")
    with (
        caplog.at_level("INFO", logger="posttrain.evaluation.served"),
        eval_server(server_cfg, model_cfg, str(adapter), tmp_path / "work", command=command()) as (_, served),
    ):
        config = json.loads((Path(served) / "config.json").read_text())
        assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
        assert AutoTokenizer.from_pretrained(served).get_vocab() == tiny_tokenizer.get_vocab()
        assert Path(served).parent.parent == tmp_path / "work"  # a scratch folder of the evaluation's
    assert [r.getMessage() for r in caplog.records] == [
        f"vllm_server: serving {adapter} merged onto its base as {served}"
    ]


def test_a_built_in_model_and_an_adapters_built_in_base_come_from_the_configured_model_cache(
    fake, tmp_path, monkeypatch
):
    from posttrain.evaluation.served import eval_server

    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "default-cache"))  # its models/: where none may go
    server_cfg, command, _ = fake
    model_cfg = ModelConfig(name="tiny-random", precision="fp32", cache_dir=str(tmp_path / "models"))
    work = tmp_path / "work"
    with eval_server(server_cfg, model_cfg, "tiny-random", work, command=command()) as (_, served):
        assert Path(served).is_relative_to(tmp_path / "models") and (Path(served) / "config.json").is_file()
    adapter, _ = _adapter_output(tmp_path, Path(served))
    (adapter / "stage.json").write_text(json.dumps({"adapter": {"base": "tiny-random"}}))
    with eval_server(server_cfg, model_cfg, str(adapter), work, command=command()) as (_, merged):
        assert (Path(merged) / "config.json").is_file()
    assert not (tmp_path / "default-cache" / "models").exists()


def test_an_adapters_base_is_loaded_with_the_configured_revision_and_cache(tmp_path, monkeypatch):
    """An adapter chain may end in a hub base: the merge loads it at ``model.revision`` from
    ``model.cache_dir``, as training did (the hub itself is out of reach here, so the loader is a spy)."""
    import posttrain.evaluation.served as served
    from posttrain.models.artifacts import ADAPTER_CONFIG

    calls = []

    class Saved:
        def save_pretrained(self, folder):
            Path(folder).mkdir(parents=True, exist_ok=True)

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return Saved(), Saved()

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / ADAPTER_CONFIG).write_text("{}")
    monkeypatch.setattr(served, "load_stage_model", spy)
    cfg = ModelConfig(name="org/base", precision="bf16", revision="v2", cache_dir=str(tmp_path / "models"))
    path = served.servable_model(str(adapter), cfg, tmp_path / "scratch")
    assert calls == [((str(adapter), "bf16", str(tmp_path / "models")), {"revision": "v2"})]
    assert Path(path).is_dir() and Path(path).parent == tmp_path / "scratch"
