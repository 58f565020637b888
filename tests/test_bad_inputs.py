"""Bad input, table-driven: every case exits 2 with exactly one line on stderr that names the file and
the key (or the file and line, or the flag), prints no traceback, and writes nothing: no store, no
tracking database. Each case goes through `posttrain run` (or `eval`), where a late failure would
cost the most: it must be found before the store is locked, a server starts or a model loads."""

from __future__ import annotations

import socket
import time

import pytest

from posttrain.cli import main
from posttrain.rewards.registry import CUSTOM_CODE_ENV

BASE = """\
name: bad
model: {name: tiny-random, precision: fp32}
data: {source: synthetic, synthetic: {num_examples: 32}, eval_size: 4}
sft: {trainer: {max_steps: 1}}
dpo: {num_prompts: 2, samples_per_prompt: 2, trainer: {max_steps: 1}}
grpo:
  stages:
    - name: s
      rewards: [{name: xml_count}]
      trainer: {max_steps: 1, num_generations: 2, per_device_train_batch_size: 2, max_completion_length: 8}
"""


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PORT = closed_port()

# (id, --set overrides or None, replacement YAML text or None, extra argv, env, expected fragment);
# "{cfg}" in a fragment is the config's path, "{tmp}" the test's folder.
CASES = [
    (
        "negative learning rate",
        ["sft.trainer.learning_rate=-1"],
        None,
        [],
        {},
        "{cfg}: sft.trainer: option 'learning_rate' must be > 0",
    ),
    (
        "zero learning rate",
        ["grpo.stages.0.trainer.learning_rate=0"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.trainer: option 'learning_rate' must be > 0",
    ),
    (
        "max_steps 0",
        ["sft.trainer.max_steps=0"],
        None,
        [],
        {},
        "{cfg}: sft.trainer: option 'max_steps' must be >= 1 (or -1",
    ),
    ("max_steps -5", ["dpo.trainer.max_steps=-5"], None, [], {}, "{cfg}: dpo.trainer: option 'max_steps'"),
    (
        "unquoted no for a trainer option (YAML boolean)",
        ["sft.trainer.save_strategy=no"],
        None,
        [],
        {},
        "{cfg}: sft.trainer: option 'save_strategy': Input should be 'no', 'steps', 'epoch' or 'best' "
        "(got False) (YAML reads unquoted yes/no/on/off/true/false as a boolean: quote the word",
    ),
    (
        "unquoted off for a config field (YAML boolean)",
        None,
        BASE.replace("name: bad", "name: bad\neval: {data: off}"),
        [],
        {},
        "{cfg}: eval.data: Input should be 'heldout', 'hub', 'local' or 'synthetic' (YAML reads unquoted",
    ),
    (
        "unquoted no for a LoRA option (YAML boolean)",
        ["model.lora.bias=no"],
        None,
        [],
        {},
        "{cfg}: model.lora: option 'bias': Input should be 'none', 'all' or 'lora_only' (got False) (YAML",
    ),
    (
        "zero epochs",
        ["sft.trainer.max_steps=-1", "sft.trainer.num_train_epochs=0"],
        None,
        [],
        {},
        "{cfg}: sft.trainer: option 'num_train_epochs' must be > 0 when max_steps is -1",
    ),
    (
        "num_generations 0",
        ["grpo.stages.0.trainer.num_generations=0"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.trainer: option 'num_generations' must be >= 2",
    ),
    (
        "num_generations 1",
        ["grpo.stages.0.trainer.num_generations=1"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.trainer: option 'num_generations' must be >= 2",
    ),
    (
        "completion length 0",
        ["grpo.stages.0.trainer.max_completion_length=0"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.trainer: option 'max_completion_length' must be >= 1",
    ),
    (
        "max_length 0",
        ["sft.trainer.max_length=0"],
        None,
        [],
        {},
        "{cfg}: sft.trainer: option 'max_length' must be >= 1",
    ),
    (
        "batch size 0",
        ["sft.trainer.per_device_train_batch_size=0"],
        None,
        [],
        {},
        "{cfg}: sft.trainer: option 'per_device_train_batch_size' must be >= 1",
    ),
    (
        "resume_from_checkpoint",
        ["sft.trainer.resume_from_checkpoint=true"],
        None,
        [],
        {},
        "{cfg}: sft.trainer: 'resume_from_checkpoint' is managed by posttrain: posttrain resumes a killed stage",
    ),
    (
        "save_only_model",
        ["sft.trainer.save_only_model=true"],
        None,
        [],
        {},
        "{cfg}: sft.trainer: 'save_only_model' is managed by posttrain: checkpoints keep the optimizer",
    ),
    (
        "push_to_hub",
        ["dpo.trainer.push_to_hub=true"],
        None,
        [],
        {},
        "{cfg}: dpo.trainer: 'push_to_hub' is managed by posttrain",
    ),
    (
        "hub_token",
        ["grpo.stages.0.trainer.hub_token=hf_x"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.trainer: 'hub_token' is managed by posttrain: credentials never go in a config",
    ),
    (
        "renamed TRL option",
        ["grpo.stages.0.trainer.kl_coef=0.1"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.trainer: unknown GRPOConfig option 'kl_coef': the KL coefficient is `beta`",
    ),
    (
        "generation batch not divisible",
        ["grpo.stages.0.trainer.generation_batch_size=3"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.trainer: GRPOConfig rejects these options",
    ),
    (
        "unknown zero_signal mode",
        ["grpo.stages.0.zero_signal=skip"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.zero_signal: Input should be 'keep', 'drop' or 'resample'",
    ),
    (
        "in-training evaluation every 0 steps",
        ["grpo.stages.0.eval_every=0"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.eval_every: Input should be greater than or equal to 1",
    ),
    (
        "duplicate YAML key",
        None,
        BASE + "seed: 1\nseed: 2\n",
        [],
        {},
        "{cfg}:12: invalid YAML: duplicate key 'seed' (first at line 11)",
    ),
    (
        "duplicate nested key",
        None,
        BASE.replace("{max_steps: 1}}\ndpo", "{max_steps: 1, max_steps: 2}}\ndpo"),
        [],
        {},
        "{cfg}:4: invalid YAML: duplicate key 'max_steps'",
    ),
    ("broken YAML", None, BASE + "eval: [\n", [], {}, "{cfg}:12: invalid YAML"),
    ("not a mapping", None, "- a\n- b\n", [], {}, "{cfg}: a config must be a YAML mapping"),
    ("model missing", None, "name: bad\n", [], {}, "{cfg}: model: Field required"),
    ("unknown key", ["bogus=1"], None, [], {}, "{cfg}: bogus: unknown key"),
    ("bad config name", ["name=my run"], None, [], {}, "{cfg}: name: String should match pattern"),
    (
        "few-shot beyond the examples",
        ["data.few_shot=99"],
        None,
        [],
        {},
        "{cfg}: data.few_shot: Input should be less than or equal to 4",
    ),
    (
        "local data without path",
        ["data.source=local"],
        None,
        [],
        {},
        "{cfg}: data: source: local needs `path`",
    ),
    (
        "missing data file",
        ["data.source=local", "data.path=nope/train.jsonl"],
        None,
        [],
        {},
        "{cfg}: data.path: no such file or folder: nope/train.jsonl",
    ),
    (
        "missing eval file",
        ["eval.data=local", "eval.path=nope/test.jsonl"],
        None,
        [],
        {},
        "{cfg}: eval.path: no such file or folder: nope/test.jsonl",
    ),
    (
        "missing extra eval set file",
        ["eval.extra_sets=[{name: gsm8k, data: local, path: nope/train.jsonl}]"],
        None,
        [],
        {},
        "{cfg}: eval.extra_sets.0.path: no such file or folder: nope/train.jsonl",
    ),
    (
        "extra eval sets with one name",
        ["eval.extra_sets=[{name: a, data: synthetic}, {name: a, data: hub}]"],
        None,
        [],
        {},
        "{cfg}: eval.extra_sets: extra set names must be unique; repeated: a",
    ),
    (
        "extra eval set name with a slash",
        ["eval.extra_sets=[{name: gsm/8k, data: hub}]"],
        None,
        [],
        {},
        "{cfg}: eval.extra_sets.0.name: set name 'gsm/8k' must be 1-40 lowercase letters",
    ),
    (
        "extra eval set named like a difficulty",
        ["eval.extra_sets=[{name: ops_2, data: synthetic}]"],
        None,
        [],
        {},
        "{cfg}: eval.extra_sets.0.name: set name 'ops_2' must be",
    ),
    (
        "extra eval set without a source",
        ["eval.extra_sets=[{name: gsm8k, limit: 10}]"],
        None,
        [],
        {},
        "{cfg}: eval.extra_sets.0.data: Field required",
    ),
    (
        "operations range on a GSM8K eval set",
        ["eval.extra_sets=[{name: gsm8k, data: hub, max_ops: 3}]"],
        None,
        [],
        {},
        "{cfg}: eval.extra_sets.0: min_ops/max_ops/numbers apply to data: synthetic only (data is hub)",
    ),
    (
        "eval operations range reversed",
        ["eval.data=synthetic", "eval.min_ops=3", "eval.max_ops=2"],
        None,
        [],
        {},
        "{cfg}: eval: min_ops (3) > max_ops (2)",
    ),
    (
        "eval size 0",
        ["data.eval_size=0"],
        None,
        [],
        {},
        "{cfg}: data.eval_size: Input should be greater than or equal to 1",
    ),
    (
        "min_ops > max_ops",
        ["data.synthetic.min_ops=5", "data.synthetic.max_ops=2"],
        None,
        [],
        {},
        "{cfg}: data.synthetic: min_ops (5) > max_ops (2)",
    ),
    (
        "unknown reward",
        ["grpo.stages.0.rewards.0.name=nope"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.rewards.0: unknown reward 'nope'",
    ),
    (
        "params on a plain reward",
        ["grpo.stages.0.rewards.0.params={bogus: 1}"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.rewards.0: reward 'xml_count' takes no params",
    ),
    (
        "custom code without opt-in",
        ["grpo.stages.0.rewards.0.name=os:system"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.rewards.0: custom reward 'os:system' would import and run code",
    ),
    (
        "bad stage name",
        ["grpo.stages.0.name=Bad Name"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.name: String should match",
    ),
    (
        "lora rank 0",
        ["model.lora={r: 0}"],
        None,
        [],
        {},
        "{cfg}: model.lora.r: Input should be greater than or equal to 1",
    ),
    (
        "4-bit without lora",
        ["model.quantization=4bit"],
        None,
        [],
        {},
        "{cfg}: model: quantization: 4bit",
    ),
    (
        "a stage fully fine-tunes a 4-bit model",
        ["model.quantization=4bit", "model.lora={r: 4}", "grpo.stages.0.lora=null"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.lora: null (full fine-tuning) cannot train a 4bit model",
    ),
    (
        "a stage's lora rank 0",
        ["dpo.lora={r: 0}"],
        None,
        [],
        {},
        "{cfg}: dpo.lora.r: Input should be greater than or equal to 1",
    ),
    ("pass@k greedy", ["eval.pass_k=2"], None, [], {}, "{cfg}: eval: pass_k > 1 needs sampling"),
    (
        "one DPO sample",
        ["dpo.samples_per_prompt=1"],
        None,
        [],
        {},
        "{cfg}: dpo.samples_per_prompt: Input should be greater",
    ),
    (
        "monitor window 1",
        ["grpo.stages.0.monitor.window=1"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.monitor.window",
    ),
    ("bad override", ["nokey"], None, [], {}, "override 'nokey' is not of the form dotted.key=value"),
    (
        "override past a list",
        ["grpo.stages.3.name=x"],
        None,
        [],
        {},
        "override grpo.stages.3.name: 'grpo.stages.3' is not an index",
    ),
    (
        "--force bogus",
        [],
        None,
        ["--force", "bogus"],
        {},
        "--force bogus: not a step of bad; steps: data, dpo, grpo-s, sft",
    ),
    (
        "unreachable tracking server",
        [f"tracking.tracking_uri=http://127.0.0.1:{PORT}"],
        None,
        [],
        {},
        f"{{cfg}}: tracking.tracking_uri: MLflow tracking server unreachable: http://127.0.0.1:{PORT}/health: connection refused",
    ),
    (
        "unreachable MLFLOW_TRACKING_URI",
        ["tracking.tracking_uri=null"],
        None,
        [],
        {"MLFLOW_TRACKING_URI": f"http://user:pw@127.0.0.1:{PORT}"},
        f"{{cfg}}: MLFLOW_TRACKING_URI=http://user:***@127.0.0.1:{PORT}: MLflow tracking server unreachable",
    ),
    (
        "unreachable PREFECT_API_URL",
        [],
        None,
        [],
        {"PREFECT_API_URL": f"http://127.0.0.1:{PORT}/api"},
        f"{{cfg}}: PREFECT_API_URL=http://127.0.0.1:{PORT}/api: Prefect server unreachable",
    ),
    (
        "tracking folder missing",
        ["tracking.tracking_uri=sqlite:///{tmp}/no/such/dir/mlflow.db"],
        None,
        [],
        {},
        "{cfg}: tracking.tracking_uri: sqlite:///{tmp}/no/such/dir/mlflow.db: folder {tmp}/no/such/dir does not exist",
    ),
    (
        "store under a file",
        ["orchestration.store={tmp}/afile/store"],
        None,
        [],
        {},
        "{cfg}: orchestration.store: cannot create the store {tmp}/afile/store: Not a directory",
    ),
    (
        "unknown launcher",
        ["training.launcher=mpi"],
        None,
        [],
        {},
        "{cfg}: training.launcher: Input should be 'inprocess' or 'accelerate'",
    ),
    (
        "missing accelerate config",
        ["training.launcher=accelerate", "training.accelerate_config=nope.yaml"],
        None,
        [],
        {},
        "{cfg}: training.accelerate_config: no such accelerate config: nope.yaml",
    ),
    (
        "a stage's missing accelerate config",
        ["grpo.stages.0.training={launcher: accelerate, accelerate_config: gone.yaml}"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.training.accelerate_config: no such accelerate config: gone.yaml",
    ),
    (
        "accelerate config without processes",
        ["training.launcher=accelerate", "training.accelerate_config={tmp}/afile"],
        None,
        [],
        {},
        "{cfg}: training.accelerate_config: {tmp}/afile is not an accelerate config",
    ),
    (
        "zero processes",
        ["training.num_processes=0"],
        None,
        [],
        {},
        "{cfg}: training.num_processes: Input should be greater than or equal to 1",
    ),
    (
        "unknown key in a stage's training",
        ["sft.training={launch: accelerate}"],
        None,
        [],
        {},
        "{cfg}: sft.training.launch: unknown key",
    ),
    (
        "zero gpu slots",
        ["orchestration.gpu_slots=0"],
        None,
        [],
        {},
        "{cfg}: orchestration.gpu_slots: Input should be greater than or equal to 1",
    ),
    (
        "shared store of an unknown filesystem",
        ["orchestration.shared_store=nosuchfs://bucket/posttrain"],
        None,
        [],
        {},
        "{cfg}: orchestration.shared_store: nosuchfs://bucket/posttrain: Protocol not known: nosuchfs",
    ),
    (
        "managed vLLM server without CUDA",  # this machine has no GPU: found before the store or a model
        [
            "vllm_server={gpus: [1]}",
            "grpo.stages.0.trainer.use_vllm=true",
            "grpo.stages.0.trainer.vllm_mode=server",
        ],
        None,
        [],
        {},
        "{cfg}: vllm_server: a managed vLLM server needs a CUDA GPU and this machine has none",
    ),
    (
        "unknown key in vllm_server",
        ["vllm_server={gpus: [1], prot: 8000}"],
        None,
        [],
        {},
        "{cfg}: vllm_server.prot: unknown key",
    ),
    (
        "trainer port that is not the managed server's",
        [
            "vllm_server={gpus: [1], port: 8000}",
            "grpo.stages.0.trainer.use_vllm=true",
            "grpo.stages.0.trainer.vllm_mode=server",
            "grpo.stages.0.trainer.vllm_server_port=9000",
        ],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.trainer.vllm_server_port: 9000 conflicts with vllm_server.port (8000)",
    ),
    (
        "chat tools on a template that cannot render tool calls",
        [
            "grpo.stages.0.tools=[calculator]",
            "grpo.stages.0.tool_protocol=chat",
            "eval.tools=[calculator]",
            "eval.tool_protocol=chat",
        ],
        None,
        [],
        {},
        "{cfg}: model.name: tiny-random: its chat template cannot render tool calls (TRL's supports_tool_calling)",
    ),
    (
        "a chat tool user evaluated without its tools",
        ["grpo.stages.0.tools=[calculator]", "grpo.stages.0.tool_protocol=chat"],
        None,
        [],
        {},
        "{cfg}: eval.tools: grpo.stages.0 trains a tool user in TRL's chat protocol, and a trained tool user "
        "is evaluated with its tools",
    ),
    (
        "custom tool without the opt-in",
        ["grpo.stages.0.tools=[os:system]", "grpo.stages.0.tool_protocol=chat"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.tools.0: custom tool 'os:system' would import and run code named by the config",
    ),
    (
        "custom tool in the inline protocol",
        ["grpo.stages.0.tools=[os:system]"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0: tools: unknown inline tool 'os:system'; inline tools are ['calculator']",
    ),
    (
        "inline calculator with generation left to vLLM",
        ["grpo.stages.0.tools=[calculator]", "grpo.stages.0.trainer.use_vllm=true"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0: tools: calculator runs in posttrain's generation engine, and these trainer "
        "options leave generation to TRL or vLLM: use_vllm",
    ),
    (
        "calculator in a vLLM evaluation",
        ["eval.tools=[calculator]", "eval.backend=vllm"],
        None,
        [],
        {},
        "{cfg}: eval: tools run in posttrain's engine (backend: hf); backend vllm cannot force tokens",
    ),
    (
        "keep best without a selection slice (would choose on nothing, or on the reported set)",
        ["grpo.stages.0.keep=best", "grpo.stages.0.eval_every=1"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.keep: best needs data.selection_size",
    ),
    (
        "keep best without eval_every",
        ["data.selection_size=4", "sft.keep=best"],
        None,
        [],
        {},
        "{cfg}: sft: keep: best needs eval_every",
    ),
    (
        "patience without keep best",
        ["dpo.eval_every=1", "dpo.patience=2"],
        None,
        [],
        {},
        "{cfg}: dpo: patience stops a stage that keeps its best checkpoint: set keep: best",
    ),
    (
        "keep best with its own save_steps",
        ["data.selection_size=4", "grpo.stages.0.keep=best", "grpo.stages.0.eval_every=1"]
        + ["grpo.stages.0.trainer.save_steps=5"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0: trainer.save_steps: keep: best sets it",
    ),
    (
        "unknown select_metric",
        ["data.selection_size=4", "sft.select_metric=loss"],
        None,
        [],
        {},
        "{cfg}: sft.select_metric: Input should be 'accuracy', 'accuracy_flexible' or 'format'",
    ),
]


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", CUSTOM_CODE_ENV):
        monkeypatch.delenv(var, raising=False)
    (tmp_path / "afile").write_text("a file, not a folder")
    return tmp_path


@pytest.fixture(scope="module", autouse=True)
def warm_imports():
    """Validation imports TRL and peft once per process (seconds): not what the time limit is about
    (imported here: a remembered pass of the same check would import neither)."""
    import peft  # noqa: F401
    import trl  # noqa: F401


def test_there_are_at_least_thirty_cases():
    assert len(CASES) >= 30 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize(
    ("sets", "text", "argv", "env", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    sets, text, argv, env, fragment, isolated, capfd, monkeypatch
):
    tmp = isolated
    cfg = tmp / "bad.yaml"
    cfg.write_text(BASE if text is None else text)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    base_sets = [
        f"orchestration.store={tmp / 'store'}",
        f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
    ]
    overrides = [s.replace("{tmp}", str(tmp)) for s in (*base_sets, *(sets or []))]
    start = time.monotonic()
    code = main(["run", str(cfg), *[a for s in overrides for a in ("--set", s)], *argv])
    elapsed = time.monotonic() - start
    out, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and out == ""
    assert fragment.format(cfg=cfg, tmp=tmp) in lines[0]
    assert not (tmp / "store").exists() and not (tmp / "mlflow.db").exists()
    assert not (tmp / ".posttrain-store").exists()
    assert not (tmp / "mlruns").exists() and not (tmp / ".posttrain").exists()
    assert elapsed < 10  # unreachable servers included: a few seconds, not MLflow's minutes of retries


@pytest.mark.parametrize(
    ("flag", "value", "fragment"),
    [
        ("--batch-size", "0", "error: --batch-size: Input should be greater than or equal to 1 (got 0)"),
        (
            "--max-new-tokens",
            "-1",
            "error: --max-new-tokens: Input should be greater than or equal to 1 (got -1)",
        ),
        ("--limit", "0", "error: --limit: Input should be greater than or equal to 1 (got 0)"),
    ],
)
def test_bad_eval_flags_are_one_line(flag, value, fragment, isolated, capfd):
    code = main(["eval", "--model", "tiny-random", "--data", "synthetic", flag, value, "--output", "out"])
    err = capfd.readouterr().err
    assert code == 2 and err.strip() == fragment
    assert not (isolated / "out").exists()


def test_a_bad_record_found_inside_a_step_is_one_line_without_prefects_tracebacks(isolated, capfd):
    """Only the data step can see a file's records: the error crosses Prefect's task and flow, which
    would each print the traceback first; the user sees posttrain's line, and the runs say FAILED."""
    import sqlite3

    tmp = isolated
    (tmp / "bad.jsonl").write_text(
        '{"question": "q?", "answer": "so #### 4"}\n{"question": "q2?", "answer": "none"}\n'
    )
    cfg = tmp / "badrec.yaml"
    cfg.write_text(
        "model: {name: tiny-random, precision: fp32}\ndata: {source: local, path: bad.jsonl, eval_size: 1}\n"
        f"tracking: {{log_model: false, tracking_uri: 'sqlite:///{tmp / 'mlflow.db'}'}}\n"
        f"orchestration: {{store: {tmp / 'store'}}}\n"
    )
    code = main(["run", str(cfg), "--set", f"model.cache_dir={tmp / 'models'}"])
    err = capfd.readouterr().err
    assert code == 2
    assert [line for line in err.splitlines() if "error" in line.lower()] == [
        "error: bad.jsonl:2: answer has no '#### <number>' final line"
    ]
    assert "Traceback" not in err and "Encountered exception" not in err
    statuses = set(sqlite3.connect(tmp / "mlflow.db").execute("select status from runs"))
    assert statuses == {("FAILED",)}
