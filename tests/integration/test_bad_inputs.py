"""Bad input, table-driven: every case exits 2 with exactly one line on stderr that names the file and
the key (or the file and line, or the flag), prints no traceback, and writes nothing: no store, no
tracking database, no remembered option check. Each case goes through `posttrain run` (or `eval`),
where a late failure would cost the most: it must be found before the store is locked, a server
starts or a model loads.

:data:`CASES` are the first round; :data:`TRUST_CASES` the second (issue 29), one group per class:
remote code a config cannot switch on, secrets that never reach the error line, a store that stays
inside itself, inputs found before anything starts, errors from deep inside libraries, absurd values.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.core.library_policy import CUSTOM_CODE_ENV

BASE = """\
name: bad
model: {name: tiny-random, precision: fp32}
data: {source: synthetic, synthetic: {num_examples: 32}, eval_size: 4}
sft: {trainer: {max_steps: 1}}
dpo: {num_prompts: 2, num_generations: 2, trainer: {max_steps: 1}}
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
SHARDED = Path(__file__).resolve().parents[2] / "configs/accelerate/fsdp2.yaml"
ZERO3 = SHARDED.with_name("zero3.yaml")

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
        "pass-rate band upside down",
        ["grpo.stages.0.pass_rate={band: [0.8, 0.2]}"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.pass_rate: band: [0.8, 0.2] is not 0 <= low < high <= 1",
    ),
    (
        "pass-rate scoring of one completion",
        ["grpo.stages.0.pass_rate={samples: 1}"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.pass_rate.samples: Input should be greater than or equal to 2",
    ),
    (
        "pass-rate scoring under sampling the engine does not do",
        ["grpo.stages.0.pass_rate={samples: 4}", "grpo.stages.0.trainer.top_p=0.9"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0: pass_rate: scoring samples at the stage's temperature alone",
    ),
    (
        "rft without the scoring it fine-tunes on",
        ["grpo.stages.0.rft={replay: 1.0}"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0: rft: fine-tunes on the completions of the stage's scoring; it needs pass_rate:",
    ),
    (
        "rft with a pass-rate band, which only chooses GRPO's prompts",
        ["grpo.stages.0.pass_rate={band: [0.1, 0.9]}", "grpo.stages.0.rft={}"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0: pass_rate.band: chooses GRPO's prompts; an rft: stage trains on every",
    ),
    (
        "rft with a GRPO-only setting",
        [
            "grpo.stages.0.pass_rate={samples: 4}",
            "grpo.stages.0.rft={}",
            "grpo.stages.0.zero_signal=resample",
        ],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0: zero_signal: is a GRPO setting; an rft: stage takes 'keep' (or leave it out)",
    ),
    (
        "rft with a GRPO option among its SFT options",
        ["grpo.stages.0.pass_rate={samples: 4}", "grpo.stages.0.rft={trainer: {num_generations: 4}}"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.rft.trainer: unknown SFTConfig option 'num_generations'",
    ),
    (
        "rft with chat-template options its fine-tuning would not apply",
        [
            "grpo.stages.0.pass_rate={samples: 4}",
            "grpo.stages.0.rft={}",
            "grpo.stages.0.trainer.chat_template_kwargs={enable_thinking: false}",
            "grpo.stages.0.rewards=[{name: correctness}]",
        ],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0: trainer.chat_template_kwargs: an rft: stage fine-tunes on the template's defaults",
    ),
    (
        "rft with an SFT option that its keep: best sets itself",
        [
            "grpo.stages.0.pass_rate={samples: 4}",
            "grpo.stages.0.rft={trainer: {eval_steps: 3}}",
            "grpo.stages.0.keep=best",
            "grpo.stages.0.eval_every=2",
            "grpo.stages.0.rewards=[{name: correctness}]",
        ],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0: rft.trainer.eval_steps: keep: best sets it",
    ),
    (
        "rft with a reward that would do nothing",
        [
            "grpo.stages.0.pass_rate={samples: 4}",
            "grpo.stages.0.rft={}",
            "grpo.stages.0.rewards=[{name: correctness}, {name: strict_format}]",
        ],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0: rewards: an rft: stage trains on what the correctness reward pays; list only "
        "correctness (got strict_format)",
    ),
    (
        "rft replaying a negative share",
        ["grpo.stages.0.pass_rate={samples: 4}", "grpo.stages.0.rft={replay: -1}"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.rft.replay: Input should be greater than or equal to 0",
    ),
    (
        "retiring prompts while keeping every group",
        ["grpo.stages.0.zero_signal_retire_after=3"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0: zero_signal_retire_after: needs zero_signal: drop or resample",
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
        "a GRPO stage's own local source without a path",
        ["grpo.stages.0.data={source: local}"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.data: source: local needs `path`",
    ),
    (
        "a missing file of a GRPO stage's own source",
        ["grpo.stages.0.data={source: local, path: nope/answers.jsonl}"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.data.path: no such file or folder: nope/answers.jsonl",
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
        "{cfg}: eval.extra_sets.0: min_ops/max_ops/numbers/themes apply to data: synthetic only (data is hub)",
    ),
    (
        "a file path on an eval set that reads the held-out slice",
        ["eval.extra_sets=[{name: bare, data: heldout, path: test.jsonl}]"],
        None,
        [],
        {},
        "{cfg}: eval.extra_sets.0: `path` applies to data: local only (data is heldout)",
    ),
    (
        "a hub split on a local eval set",
        ["eval.data=local", "eval.path=test.jsonl", "eval.hub_split=train"],
        None,
        [],
        {},
        "{cfg}: eval: `hub_split` applies to data: hub only (data is local)",
    ),
    (
        "a negative seed (numpy's range, where transformers' set_seed fails after the model loads)",
        ["seed=-1"],
        None,
        [],
        {},
        "{cfg}: seed: Input should be greater than or equal to 0",
    ),
    (
        "an evaluation seed past numpy's range",
        ["eval.seed=4294967296"],
        None,
        [],
        {},
        "{cfg}: eval.seed: Input should be less than 4294967296",
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
        "a story the generator does not have",
        ["data.synthetic.themes=[farm, pirates]"],
        None,
        [],
        {},
        "{cfg}: data.synthetic.themes.1: Input should be 'shopping', 'savings', 'baking',",
    ),
    (
        "no stories at all",
        ["data.synthetic.themes=[]"],
        None,
        [],
        {},
        "{cfg}: data.synthetic.themes: List should have at least 1 item after validation, not 0",
    ),
    (
        "stories on an evaluation set that reads the held-out slice",
        ["eval.extra_sets=[{name: unseen, data: heldout, themes: [farm]}]"],
        None,
        [],
        {},
        "{cfg}: eval.extra_sets.0: min_ops/max_ops/numbers/themes apply to data: synthetic only (data is heldout)",
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
        ["dpo.num_generations=1"],
        None,
        [],
        {},
        "{cfg}: dpo.num_generations: Input should be greater",
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
        "{cfg}: tracking.tracking_uri: folder {tmp}/no/such/dir does not exist",
    ),
    (
        "MLFLOW_TRACKING_URI folder missing",
        ["tracking.tracking_uri=null"],
        None,
        [],
        {"MLFLOW_TRACKING_URI": "sqlite:///no/such/dir/mlflow.db"},
        "{cfg}: MLFLOW_TRACKING_URI=sqlite:///{tmp}/no/such/dir/mlflow.db: folder {tmp}/no/such/dir does not exist",
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
        ["launch.launcher=mpi"],
        None,
        [],
        {},
        "{cfg}: launch.launcher: Input should be 'inprocess' or 'accelerate'",
    ),
    (
        "missing accelerate config",
        ["launch.launcher=accelerate", "launch.accelerate_config=nope.yaml"],
        None,
        [],
        {},
        "{cfg}: launch.accelerate_config: no such accelerate config: nope.yaml",
    ),
    (
        "a stage's missing accelerate config",
        ["grpo.stages.0.launch={launcher: accelerate, accelerate_config: gone.yaml}"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.launch.accelerate_config: no such accelerate config: gone.yaml",
    ),
    (
        "accelerate config without processes",
        ["launch.launcher=accelerate", "launch.accelerate_config={tmp}/afile"],
        None,
        [],
        {},
        "{cfg}: launch.accelerate_config: {tmp}/afile is not an accelerate config",
    ),
    (
        "zero processes",
        ["launch.num_processes=0"],
        None,
        [],
        {},
        "{cfg}: launch.num_processes: Input should be greater than or equal to 1",
    ),
    (
        "absurd pass-rate samples",
        ["grpo.stages.0.zero_signal=drop", "grpo.stages.0.pass_rate={samples: 1000000}"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.pass_rate.samples: 1000000 is more than posttrain can use (at most 1,024)",
    ),
    (
        "a pool refresh with a sharded policy",
        [
            "launch.launcher=accelerate",
            f"launch.accelerate_config={SHARDED}",
            "grpo.stages.0.zero_signal=drop",
            "grpo.stages.0.pass_rate={refresh_every: 2}",
        ],
        None,
        [],
        {},
        f"{{cfg}}: grpo.stages.0.pass_rate.refresh_every: the pool refresh generates with the whole "
        f"policy on each process ({SHARDED} shards it: FSDP); launch this stage with DDP "
        f"(configs/accelerate/ddp.yaml) or leave refresh_every unset",
    ),
    (
        "a pool refresh with a ZeRO-3 policy, in the stage's own launch",
        [
            f"grpo.stages.0.launch={{launcher: accelerate, accelerate_config: {ZERO3}}}",
            "grpo.stages.0.zero_signal=drop",
            "grpo.stages.0.pass_rate={refresh_every: 2}",
        ],
        None,
        [],
        {},
        f"{{cfg}}: grpo.stages.0.pass_rate.refresh_every: the pool refresh generates with the whole "
        f"policy on each process ({ZERO3} shards it: DeepSpeed ZeRO-3)",
    ),
    (
        "unknown key in a stage's launch",
        ["sft.launch={launchr: accelerate}"],
        None,
        [],
        {},
        "{cfg}: sft.launch.launchr: unknown key",
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
        "a GRPO stage's own selection slice that nothing reads",
        ["grpo.stages.0.data={source: synthetic, selection_size: 8}"],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0: data.selection_size: only the stage's in-training evaluations read its "
        "selection slice; set eval_every, or remove it",
    ),
    (
        "a GRPO stage's own selection slice as large as its synthetic source",
        [
            "grpo.stages.0.data={source: synthetic, selection_size: 50, synthetic: {num_examples: 50}}",
            "grpo.stages.0.eval_every=1",
        ],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.data: selection_size: 50 of the 50 synthetic problems leaves none to train on",
    ),
    (
        "a GRPO stage's own selection slice cut from the run's own data",
        [
            "grpo.stages.0.data={source: synthetic, synthetic: {num_examples: 32}, selection_size: 4}",
            "grpo.stages.0.eval_every=1",
        ],
        None,
        [],
        {},
        "{cfg}: grpo.stages.0.data.selection_size: the stage's source is the run's data, whose records are "
        "held out or trained on; set data.selection_size for a slice of them",
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

SECRET = "s3cr@t:pw%40x"
"""A password holding the characters that broke redaction before (issue 29): '@', ':', '%40'."""
SLASH_SECRET = "s3cr@t:p/w"
"""One holding '/' too: no URI parser reads the host after it, so only its form can be judged."""
SECRET_PARTS = ("s3cr", "pw%40x", "p/w")


def _fifo(name: str):
    """A setup that makes ``name`` (relative to the test's folder) a FIFO. A writer feeds it after a
    few seconds, so code that wrongly reads it fails the test instead of hanging it."""

    def setup(tmp: Path) -> None:
        path = tmp / name
        path.unlink(missing_ok=True)
        os.mkfifo(path)

        def feed() -> None:
            time.sleep(5)
            with open(path, "w") as fh:  # noqa: PTH123 - blocks until a reader opens it
                fh.write(BASE)

        threading.Thread(target=feed, daemon=True).start()

    return setup


def _files(files: dict[str, str] | None = None, dirs: tuple[str, ...] = ()):
    """A setup that makes ``dirs`` and writes ``files`` (name -> text) in the test's folder."""

    def setup(tmp: Path) -> None:
        for name in dirs:
            (tmp / name).mkdir(parents=True, exist_ok=True)
        for name, content in (files or {}).items():
            (tmp / name).write_text(content)

    return setup


def _linked_store(tmp: Path) -> None:
    (tmp / "linked").mkdir()
    (tmp / "linked" / ".posttrain-store").write_text("{}")
    (tmp / "outside" / "x.tmp-1").mkdir(parents=True)
    (tmp / "linked" / "stages").symlink_to(tmp / "outside")


def _alias_bomb() -> str:
    """897 bytes that expand to 10^7 values (the example of issue 29)."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 8):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\n" + BASE


DEEP = 5000
# (id, --set overrides, config text (str or bytes; None: BASE), extra argv, env, setup(tmp) or None,
# expected fragment); the second round of cases, one group per class of issue 29.
TRUST_CASES = [
    # -- 1. a config cannot make a library load or run code without the opt-in from outside it
    (
        "trust_remote_code in a trainer",
        ["sft.trainer.trust_remote_code=true"],
        None,
        [],
        {},
        None,
        "{cfg}: sft.trainer: option 'trust_remote_code' would let transformers and vLLM run the model "
        "repository's own code; allow it with --allow-custom-code",
    ),
    (
        "trust_remote_code as a YAML word",  # TRL would read 'yes' as true
        ["grpo.stages.0.trainer.trust_remote_code='yes'"],
        None,
        [],
        {},
        None,
        "{cfg}: grpo.stages.0.trainer: option 'trust_remote_code' would let",
    ),
    (
        "trust_remote_code in model_init_kwargs (the reference model)",
        [
            "grpo.stages.0.trainer.beta=0.1",
            "grpo.stages.0.trainer.model_init_kwargs={trust_remote_code: true}",
        ],
        None,
        [],
        {},
        None,
        "{cfg}: grpo.stages.0.trainer: option 'model_init_kwargs.trust_remote_code' would let",
    ),
    (
        "hub kernels in model_init_kwargs",
        ["dpo.trainer.model_init_kwargs={use_kernels: true}"],
        None,
        [],
        {},
        None,
        "{cfg}: dpo.trainer: option 'model_init_kwargs.use_kernels' would download and run kernels",
    ),
    (
        "a from_pretrained option off the allow list",
        ["grpo.stages.0.trainer.model_init_kwargs={pretrained_model_name_or_path: evil/model}"],
        None,
        [],
        {},
        None,
        "{cfg}: grpo.stages.0.trainer: option 'model_init_kwargs.pretrained_model_name_or_path' is not "
        "among the loading options a config may pass",
    ),
    (
        "a generation loop from the hub",
        ["grpo.stages.0.trainer.generation_kwargs={custom_generate: evil/loop}"],
        None,
        [],
        {},
        None,
        "{cfg}: grpo.stages.0.trainer: option 'generation_kwargs.custom_generate' would download and run",
    ),
    (
        "attention kernel from a hub repository",
        ["model.attn_implementation=kernels-community/flash-attn"],
        None,
        [],
        {},
        None,
        "{cfg}: model.attn_implementation: attn_implementation 'kernels-community/flash-attn' names a "
        "kernel repository on the Hugging Face Hub",
    ),
    (
        "attention kernel from a hub repository in model_init_kwargs",
        ["grpo.stages.0.trainer.model_init_kwargs={attn_implementation: 'evil/kernel:fn'}"],
        None,
        [],
        {},
        None,
        "{cfg}: grpo.stages.0.trainer: model_init_kwargs.attn_implementation 'evil/kernel:fn' names a kernel",
    ),
    (
        "an attention implementation transformers does not have",
        ["model.attn_implementation=fastest"],
        None,
        [],
        {},
        None,
        "{cfg}: model.attn_implementation: attn_implementation 'fastest' is not one of transformers'",
    ),
    (
        "peft imports a module by name",
        ["model.lora={r: 4, megatron_core: os, megatron_config: {}}"],
        None,
        [],
        {},
        None,
        "{cfg}: model.lora: option 'megatron_core' names a module peft imports",
    ),
    (
        "server flags abbreviated (--mod, --hos)",  # argparse would swap the model, bind every interface
        ["vllm_server={gpus: [1], extra_args: [--mod, other/model, --hos, 0.0.0.0]}"],
        None,
        [],
        {},
        None,
        "{cfg}: vllm_server.extra_args: '--mod': abbreviations are refused (argparse would read it as --model)",
    ),
    (
        "server flag abbreviated with =",
        ["vllm_server={gpus: [1], extra_args: [--hos=0.0.0.0]}"],
        None,
        [],
        {},
        None,
        "{cfg}: vllm_server.extra_args: '--hos=0.0.0.0': abbreviations are refused (argparse would read it as --host)",
    ),
    (
        "server flag off the allow list",
        ["vllm_server={gpus: [1], extra_args: [--trust-remote-code]}"],
        None,
        [],
        {},
        None,
        "{cfg}: vllm_server.extra_args: --trust-remote-code is not among the server flags a config may pass",
    ),
    (
        "server config file that sets environment variables",
        ["vllm_server={gpus: [1], extra_args: [--config, env.yaml]}"],
        None,
        [],
        {},
        None,
        "{cfg}: vllm_server.extra_args: --config is not among the server flags",
    ),
    (
        "a bare word in server flags (another model to vllm serve)",
        ["vllm_server={gpus: [1], extra_args: [other/model]}"],
        None,
        [],
        {},
        None,
        "{cfg}: vllm_server.extra_args: 'other/model' is not a --flag",
    ),
    (
        "a server flag's value out of range",
        ["vllm_server={gpus: [1], extra_args: [--gpu-memory-utilization, '1.5']}"],
        None,
        [],
        {},
        None,
        "{cfg}: vllm_server.extra_args: --gpu-memory-utilization: '1.5' is not a fraction in (0, 1]",
    ),
    (
        "posttrain's own server flag even with the opt-in",
        ["vllm_server={gpus: [1], extra_args: [--model, other/model]}"],
        None,
        [],
        {CUSTOM_CODE_ENV: "1"},
        None,
        "{cfg}: vllm_server.extra_args: --model is set by posttrain (the stage's model); remove it",
    ),
    # -- 2. secrets never reach the error line (nor disk: tests/integration/test_secrets.py)
    (
        "password with @ : / and %40 in an unreachable MLFLOW_TRACKING_URI",
        ["tracking.tracking_uri=null"],
        None,
        [],
        {"MLFLOW_TRACKING_URI": f"http://user:{SECRET}@127.0.0.1:{PORT}"},
        None,
        f"{{cfg}}: MLFLOW_TRACKING_URI=http://user:***@127.0.0.1:{PORT}: MLflow tracking server unreachable",
    ),
    (
        "password with / in MLFLOW_TRACKING_URI",
        ["tracking.tracking_uri=null"],
        None,
        [],
        {"MLFLOW_TRACKING_URI": f"http://user:{SLASH_SECRET}@127.0.0.1:{PORT}"},
        None,
        f"{{cfg}}: MLFLOW_TRACKING_URI=http://user:***@127.0.0.1:{PORT}: not a URI",
    ),
    (
        "credential in a trainer option",  # transformers would log it to MLflow as it is
        [f"sft.trainer.run_name=https://u:{SECRET}@runs.example.com/x"],
        None,
        [],
        {},
        None,
        "{cfg}: sft.trainer: option 'run_name' holds a credential",
    ),
    (
        "a model named by a URL with credentials",
        [f"model.name=https://user:{SECRET}@huggingface.co/org/model"],
        None,
        [],
        {},
        None,
        "{cfg}: model.name: https://user:***@huggingface.co/org/model is a URL, not a model",
    ),
    # -- 3. only a marked folder is a store, and a store stays inside itself
    (
        "a folder holding only data/ and results/ is not a store",
        ["orchestration.store={tmp}/lookalike"],
        None,
        [],
        {},
        _files(dirs=("lookalike/data", "lookalike/results")),
        "{cfg}: orchestration.store: {tmp}/lookalike is not a posttrain store (no .posttrain-store marker) "
        "and holds data, results",
    ),
    (
        "a store whose stages/ links outside it",
        ["orchestration.store={tmp}/linked"],
        None,
        [],
        {},
        _linked_store,
        "{cfg}: orchestration.store: {tmp}/linked/stages is a symbolic link",
    ),
    # -- 5. found before any store, lock, server or model: the model, paths, URIs
    (
        "missing model folder",
        ["model.name=./models/none"],
        None,
        [],
        {},
        None,
        "{cfg}: model.name: ./models/none: no such file or folder",
    ),
    (
        "missing .gguf file",
        ["model.name=weights/model.Q4.gguf"],
        None,
        [],
        {},
        None,
        "{cfg}: model.name: weights/model.Q4.gguf: no such file or folder",
    ),
    (
        "a folder that is not a model",
        ["model.name={tmp}/notamodel"],
        None,
        [],
        {},
        _files(dirs=("notamodel",)),
        "{cfg}: model.name: {tmp}/notamodel is not a Hugging Face model folder (no config.json)",
    ),
    (
        "a .gguf name that is a folder",
        ["model.name={tmp}/dir.gguf"],
        None,
        [],
        {},
        _files(dirs=("dir.gguf",)),
        "{cfg}: model.name: {tmp}/dir.gguf is a folder, not a file",
    ),
    (
        "a model named by a file:// URL",
        ["model.name=file:///models/llama"],
        None,
        [],
        {},
        None,
        "{cfg}: model.name: file:///models/llama is a URL, not a model",
    ),
    (
        "a model name that is no hub id",
        ["model.name=org/../model"],
        None,
        [],
        {},
        None,
        "{cfg}: model.name: 'org/../model' is not a hub id (org/name)",
    ),
    (
        "config is a FIFO",
        None,
        None,
        [],
        {},
        _fifo("bad.yaml"),
        "{cfg}: cannot read config: it is a FIFO (named pipe), not a regular file or folder",
    ),
    (
        "data path is a FIFO",
        ["data.source=local", "data.path=pipe.jsonl"],
        None,
        [],
        {},
        _fifo("pipe.jsonl"),
        "{cfg}: data.path: pipe.jsonl is a FIFO (named pipe), not a regular file or folder",
    ),
    (
        "eval path is a device",
        ["eval.data=local", "eval.path=/dev/zero"],
        None,
        [],
        {},
        None,
        "{cfg}: eval.path: /dev/zero is a character device, not a regular file or folder",
    ),
    (
        "accelerate config is a FIFO",
        ["launch.launcher=accelerate", "launch.accelerate_config=pipe.yaml"],
        None,
        [],
        {},
        _fifo("pipe.yaml"),
        "{cfg}: launch.accelerate_config: pipe.yaml is a FIFO (named pipe)",
    ),
    (
        "malformed local data line",  # before: found 13 s into the run, after mlflow.db existed
        ["data.source=local", "data.path=bad.jsonl"],
        None,
        [],
        {},
        _files(
            {
                "bad.jsonl": '{"question": "q?", "answer": "so #### 4"}\n{"question": "q2?", "answer": "none"}\n'
            }
        ),
        "{cfg}: data.path: bad.jsonl:2: answer has no '#### <number>' final line",
    ),
    (
        "malformed eval data line",
        ["eval.data=local", "eval.path=test.jsonl"],
        None,
        [],
        {},
        _files({"test.jsonl": '{"question": "q?", "answer": "so #### 4"}\n{"question": \n'}),
        "{cfg}: eval.path: test.jsonl:2: malformed JSON",
    ),
    (
        "unreachable tracking database (not http)",
        [f"tracking.tracking_uri=postgresql://mlflow:{SECRET}@127.0.0.1:{PORT}/mlflow"],
        None,
        [],
        {},
        None,
        f"{{cfg}}: tracking.tracking_uri: MLflow tracking database unreachable: 127.0.0.1:{PORT}: connection refused",
    ),
    (
        "a tracking URI MLflow cannot use",
        ["tracking.tracking_uri=ftp://host/mlruns"],
        None,
        [],
        {},
        None,
        "{cfg}: tracking.tracking_uri: ftp is not a tracking store MLflow knows",
    ),
    (
        "a database tracking URI without a host",
        ["tracking.tracking_uri=postgresql:///mlflow"],
        None,
        [],
        {},
        None,
        "{cfg}: tracking.tracking_uri: postgresql needs a host",
    ),
    (
        "PREFECT_API_URL that is not a URL",
        [],
        None,
        [],
        {"PREFECT_API_URL": "localhost:4200/api"},
        None,
        "{cfg}: PREFECT_API_URL=localhost:4200/api: not an http(s) URL of a Prefect API",
    ),
    # -- 6. what reaches deep into a library: encodings, nesting, names the file system refuses
    ("config in Latin-1", None, ("# café\n" + BASE).encode("latin-1"), [], {}, None, "{cfg}: not UTF-8 text"),
    ("config in UTF-16", None, BASE.encode("utf-16"), [], {}, None, "{cfg}: not UTF-8 text"),
    (
        "YAML nested thousands deep",
        None,
        BASE + "extra: " + "[" * DEEP + "]" * DEEP + "\n",
        [],
        {},
        None,
        "{cfg}:11: nested deeper than 32 levels",
    ),
    (
        "--set nested thousands deep",
        ["data.synthetic=" + "[" * DEEP + "]" * DEEP],
        None,
        [],
        {},
        None,
        "override data.synthetic:1: nested deeper than 32 levels",
    ),
    (
        "--set key path thousands deep",
        [".".join(["x"] * DEEP) + "=1"],
        None,
        [],
        {},
        None,
        "{cfg}: nested deeper than 32 levels",
    ),
    (
        "a JSONL line nested thousands deep",
        ["data.source=local", "data.path=deep.jsonl"],
        None,
        [],
        {},
        _files({"deep.jsonl": '{"question": ' + "[" * DEEP + "]" * DEEP + ', "answer": "#### 1"}\n'}),
        "{cfg}: data.path: deep.jsonl:1: nested too deeply to be a GSM8K record",
    ),
    # Issue 38: inputs a user meets in the first hour, each found before the store or mlflow.db exists.
    (
        "an empty local data file",
        ["data.source=local", "data.path=empty.jsonl"],
        None,
        [],
        {},
        _files({"empty.jsonl": ""}),
        "{cfg}: data.path: empty.jsonl: no usable GSM8K records (it holds no records)",
    ),
    (
        "a local data file whose every line is bad (skipped)",
        ["data.source=local", "data.path=bad.jsonl", "data.on_bad_record=skip"],
        None,
        [],
        {},
        _files({"bad.jsonl": 'oops\n{"question": "q?", "answer": "none"}\n\n'}),
        "{cfg}: data.path: bad.jsonl: no usable GSM8K records (all 2 skipped as bad; the first: "
        "bad.jsonl:1: malformed JSON",
    ),
    (
        "a tracking database that is a folder",  # MLflow retried "unable to open" for minutes
        ["tracking.tracking_uri=sqlite:///{tmp}/db"],
        None,
        [],
        {},
        _files(dirs=("db",)),
        "{cfg}: tracking.tracking_uri: {tmp}/db is not a file",
    ),
    (
        "a tracking database that is not SQLite",
        ["tracking.tracking_uri=sqlite:///{tmp}/notes.db"],
        None,
        [],
        {},
        _files({"notes.db": "hello\n"}),
        "{cfg}: tracking.tracking_uri: {tmp}/notes.db is not an SQLite database",
    ),
    (
        "a GRPO stage's own selection slice that takes every record of its file",
        [
            "grpo.stages.0.data={source: local, path: answers.jsonl, selection_size: 2}",
            "grpo.stages.0.eval_every=1",
        ],
        None,
        [],
        {},
        _files(
            {
                "answers.jsonl": '{"question": "q1", "answer": "#### 1"}\n{"question": "q2", "answer": "#### 2"}\n'
            }
        ),
        "{cfg}: grpo.stages.0.data.selection_size: 2 of the 2 records of answers.jsonl leaves none to train on",
    ),
    (
        "an empty file of a GRPO stage's own source",
        ["grpo.stages.0.data={source: local, path: answers.jsonl}"],
        None,
        [],
        {},
        _files({"answers.jsonl": "\n"}),
        "{cfg}: grpo.stages.0.data.path: answers.jsonl: no usable GSM8K records (it holds no records)",
    ),
    (
        "a bad line in a GRPO stage's own source, read with the run's bad-record rule",
        ["grpo.stages.0.data={source: local, path: answers.jsonl}"],
        None,
        [],
        {},
        _files({"answers.jsonl": '{"question": "q"}\n'}),
        "{cfg}: grpo.stages.0.data.path: answers.jsonl:1:",
    ),
    (
        "an empty extra evaluation set file",
        ["eval.extra_sets=[{name: test, data: local, path: test.jsonl}]"],
        None,
        [],
        {},
        _files({"test.jsonl": "\n"}),
        "{cfg}: eval.extra_sets.0.path: test.jsonl: no usable GSM8K records (it holds no records)",
    ),
    (
        "a missing extra evaluation set file (final model only)",
        ["eval.extra_sets=[{name: test, data: local, path: gsm8k/test.jsonl, final_only: true}]"],
        None,
        [],
        {},
        _files(dirs=("gsm8k",)),
        "{cfg}: eval.extra_sets.0.path: no such file or folder: gsm8k/test.jsonl",
    ),
    (
        "an extra evaluation set that is a directory",
        ["eval.extra_sets=[{name: test, data: local, path: gsm8k}]"],
        None,
        [],
        {},
        _files({"gsm8k/README": "the splits go here\n"}, dirs=("gsm8k",)),
        "{cfg}: eval.extra_sets.0.path: gsm8k: folder contains no *.jsonl files",
    ),
    (
        "a misspelt flag",
        [],
        None,
        ["--dryrun"],
        {},
        None,
        "error: posttrain run: unknown flag --dryrun: did you mean --dry-run?",
    ),
    (
        "a flag another command has",
        [],
        None,
        ["--max-new-tokens", "64"],
        {},
        None,
        "error: posttrain run: unknown flag --max-new-tokens: 'posttrain run --help' lists its flags",
    ),
    (
        "a stage name too long for the file system",
        ["grpo.stages.0.name=" + "s" * 300],
        None,
        [],
        {},
        None,
        "{cfg}: grpo.stages.0.name: 300 characters; at most 64",
    ),
    (
        "an extra set name ending in a newline",
        ['eval.extra_sets=[{name: "gsm\\n", data: synthetic}]'],
        None,
        [],
        {},
        None,
        "{cfg}: eval.extra_sets.0.name: set name 'gsm\\n' must be",
    ),
    ("a YAML alias bomb", None, _alias_bomb(), [], {}, None, "{cfg}:1: expands to more than 100,000 values"),
    ("a config of megabytes", None, BASE + "#" * (1 << 21), [], {}, None, "{cfg}: larger than 1024 KiB"),
    # -- 7. absurd values
    (
        "NaN reward weight",
        ["grpo.stages.0.rewards.0.weight=.nan"],
        None,
        [],
        {},
        None,
        "{cfg}: grpo.stages.0.rewards.0.weight: must be a finite number, got nan",
    ),
    (
        "infinite learning rate",
        ["sft.trainer.learning_rate=.inf"],
        None,
        [],
        {},
        None,
        "{cfg}: sft.trainer.learning_rate: must be a finite number, got inf",
    ),
    (
        "learning rate 'nan' as text (coerced by TRL's type)",
        ["dpo.trainer.learning_rate='nan'"],
        None,
        [],
        {},
        None,
        "{cfg}: dpo.trainer: option 'learning_rate' must be > 0, got nan",
    ),
    (
        "infinite monitor threshold (a typed field)",
        ["grpo.stages.0.monitor.kl_threshold=.inf"],
        None,
        [],
        {},
        None,
        "{cfg}: grpo.stages.0.monitor.kl_threshold: must be a finite number, got inf",
    ),
    (
        "max_completion_length beyond the model's context",
        ["eval.max_completion_length=100000"],
        None,
        [],
        {},
        None,
        "{cfg}: eval.max_completion_length: 100000 tokens is beyond the context of tiny-random (2048 tokens)",
    ),
    (
        "an rft stage's fine-tuning length beyond the model's context",
        [
            "grpo.stages.0.pass_rate={samples: 4}",
            "grpo.stages.0.rewards=[{name: correctness}]",
            "grpo.stages.0.rft={trainer: {max_length: 4096}}",
        ],
        None,
        [],
        {},
        None,
        "{cfg}: grpo.stages.0.rft.trainer.max_length: 4096 tokens is beyond the context of tiny-random",
    ),
    (
        "completion length beyond the model's context",
        ["grpo.stages.0.trainer.max_completion_length=4096"],
        None,
        [],
        {},
        None,
        "{cfg}: grpo.stages.0.trainer.max_completion_length: 4096 tokens is beyond the context of tiny-random",
    ),
    (
        "batch size of 10^5",
        ["sft.trainer.per_device_train_batch_size=100000"],
        None,
        [],
        {},
        None,
        "{cfg}: sft.trainer: option 'per_device_train_batch_size' must be at most 65,536, got 100000",
    ),
    (
        "num_generations of 10^5",
        ["grpo.stages.0.trainer.num_generations=100000"],
        None,
        [],
        {},
        None,
        "{cfg}: grpo.stages.0.trainer: option 'num_generations' must be at most 4,096",
    ),
    (
        "10^12 synthetic examples",
        ["data.synthetic.num_examples=1000000000000"],
        None,
        [],
        {},
        None,
        "{cfg}: data.synthetic.num_examples: 1000000000000 is more than posttrain can use (at most 10,000,000)",
    ),
    (
        "evaluation batch of a million",
        ["eval.batch_size=1000000"],
        None,
        [],
        {},
        None,
        "{cfg}: eval.batch_size: 1000000 is more than posttrain can use (at most 65,536)",
    ),
    (
        "a number beyond any setting",
        ["seed=1.0e+300"],
        None,
        [],
        {},
        None,
        "{cfg}: seed: 1e+300 is beyond any sensible setting",
    ),
]


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for var in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", CUSTOM_CODE_ENV, "POSTTRAIN_CHECK_MEMO"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("POSTTRAIN_CACHE", str(tmp_path / "cache"))  # remembered checks land here
    (tmp_path / "afile").write_text("a file, not a folder")
    return tmp_path


# (id, --set overrides, expected fragment): issue 32's pass over the schema. Renamed keys fail with
# the new name, where an old config or an old command line would otherwise meet "unknown key"; the
# seeds that are not the run's (trainer:'s, a greedy evaluation's) point to the one that is; an error
# in a key a GRPO stage took from grpo.defaults names the default.
RENAMED_CASES = [
    (
        "top-level training: is launch:",
        ["training.launcher=accelerate"],
        "{cfg}: training: renamed to 'launch' (how stages are launched; TRL's options stay in trainer:)",
    ),
    (
        "a stage's training: is launch:",
        ["grpo.stages.0.training={num_processes: 2}"],
        "{cfg}: grpo.stages.0.training: renamed to 'launch'",
    ),
    (
        "sft's num_examples is limit",
        ["sft.num_examples=4"],
        "{cfg}: sft.num_examples: renamed to 'limit' (the first N",
    ),
    (
        "a stage filter's num_examples is limit",
        ["grpo.stages.0.data_filter={num_examples: 4}"],
        "{cfg}: grpo.stages.0.data_filter.num_examples: renamed to 'limit'",
    ),
    (
        "dpo's samples_per_prompt is num_generations",
        ["dpo.samples_per_prompt=2"],
        "{cfg}: dpo.samples_per_prompt: renamed to 'num_generations' (TRL's name for completions per prompt",
    ),
    (
        "dpo's max_new_tokens is max_completion_length",
        ["dpo.max_new_tokens=8"],
        "{cfg}: dpo.max_new_tokens: renamed to 'max_completion_length' (TRL's name for the completion length",
    ),
    (
        "eval's max_new_tokens is max_completion_length",
        ["eval.max_new_tokens=8"],
        "{cfg}: eval.max_new_tokens: renamed to 'max_completion_length'",
    ),
    (
        "an extra set's max_new_tokens is max_completion_length",
        ["eval.extra_sets=[{name: more, data: heldout, max_new_tokens: 8}]"],
        "{cfg}: eval.extra_sets.0.max_new_tokens: renamed to 'max_completion_length'",
    ),
    (
        "the generator's seed is data.seed",
        ["data.synthetic.seed=1"],
        "{cfg}: data.synthetic.seed: renamed to 'data.seed' (one seed for the generated problems and the split",
    ),
    (
        "a trainer's seed is the run's seed",
        ["grpo.stages.0.trainer.seed=1"],
        "{cfg}: grpo.stages.0.trainer: 'seed' is managed by posttrain: the run's seed is the top-level `seed`",
    ),
    (
        "a trainer's data_seed is the run's seed",
        ["sft.trainer.data_seed=1"],
        "{cfg}: sft.trainer: 'data_seed' is managed by posttrain: the run's seed is the top-level `seed`",
    ),
    (
        "an evaluation seed without sampling",
        ["eval.seed=1"],
        "{cfg}: eval: seed 1 draws nothing at temperature 0 (greedy)",
    ),
    (
        "a default's bad trainer option names the default",
        ["grpo.defaults.trainer.learning_rate=-1"],
        "{cfg}: grpo.defaults.trainer: option 'learning_rate' must be > 0",
    ),
    (
        "a default beyond the bounds names the default",
        ["grpo.defaults.eval_limit=100000000"],
        "{cfg}: grpo.defaults.eval_limit: 100000000 is more than posttrain can use",
    ),
]

_DEFAULT_REWARDS = BASE.replace(
    "grpo:\n  stages:", "grpo:\n  defaults: {rewards: [{name: nope}]}\n  stages:"
).replace("      rewards: [{name: xml_count}]\n", "")
# (id, config text, expected fragment): a GRPO stage's keys from grpo.defaults, checked after the merge.
DEFAULTS_TEXT_CASES = [
    (
        "an unknown reward among the defaults",
        _DEFAULT_REWARDS,
        "{cfg}: grpo.defaults.rewards.0: unknown reward 'nope'",
    ),
]

ALL_CASES = (
    [(*c[:5], None, c[5]) for c in CASES]
    + TRUST_CASES
    + [(name, sets, None, [], {}, None, fragment) for name, sets, fragment in RENAMED_CASES]
    + [(name, None, text, [], {}, None, fragment) for name, text, fragment in DEFAULTS_TEXT_CASES]
)


def _tree(root: Path) -> dict[str, int]:
    """Every entry under ``root`` (links not followed) with its modification time."""
    found = {}
    for top, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            path = os.path.join(top, name)
            found[os.path.relpath(path, root)] = os.lstat(path).st_mtime_ns
    return found


@pytest.mark.parametrize(
    ("sets", "text", "argv", "env", "setup", "fragment"),
    [c[1:] for c in ALL_CASES],
    ids=[c[0] for c in ALL_CASES],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(
    sets, text, argv, env, setup, fragment, isolated, capfd, monkeypatch
):
    tmp = isolated
    cfg = tmp / "bad.yaml"
    content = BASE if text is None else text
    if isinstance(content, bytes):
        cfg.write_bytes(content)
    else:
        cfg.write_text(content)
    if setup is not None:
        setup(tmp)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    base_sets = [
        f"orchestration.store={tmp / 'store'}",
        f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
    ]
    overrides = [s.replace("{tmp}", str(tmp)) for s in (*base_sets, *(sets or []))]
    before = _tree(tmp)
    code = main(["run", str(cfg), *[a for s in overrides for a in ("--set", s)], *argv])
    out, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and out == ""
    assert fragment.format(cfg=cfg, tmp=tmp) in lines[0]
    assert not any(part in err for part in SECRET_PARTS), err  # planted secrets are never shown
    assert _tree(tmp) == before  # no store, no mlflow.db, no remembered check: nothing at all


@pytest.mark.parametrize(
    ("flag", "value", "fragment"),
    [
        ("--batch-size", "0", "error: --batch-size: Input should be greater than or equal to 1 (got 0)"),
        (
            "--max-completion-length",
            "-1",
            "error: --max-completion-length: Input should be greater than or equal to 1 (got -1)",
        ),
        ("--limit", "0", "error: --limit: Input should be greater than or equal to 1 (got 0)"),
    ],
)
def test_bad_eval_flags_are_one_line(flag, value, fragment, isolated, capfd):
    code = main(["eval", "--model", "tiny-random", "--data", "synthetic", flag, value, "--output", "out"])
    err = capfd.readouterr().err
    assert code == 2 and err.strip() == fragment
    assert not (isolated / "out").exists()


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["eval", "--model", "tiny-random", "--data", "synthetic", "--max-new-tokens", "64"],
            "error: posttrain eval: --max-new-tokens: renamed to --max-completion-length",
        ),
        (
            ["eval", "--model", "tiny-random", "--data", "synthetic", "--max-completion-lenght=64"],
            "error: posttrain eval: unknown flag --max-completion-lenght: did you mean --max-completion-length?",
        ),
        (
            ["eval", "--model", "tiny-random", "--precision", "fp8"],
            "error: posttrain eval: argument --precision: invalid choice: 'fp8' (choose from 'auto', "
            "'fp32', 'bf16', 'fp16')",
        ),
        (["eval", "--model", "tiny-random", "extra"], "error: posttrain eval: unexpected argument 'extra'"),
        (
            ["data", "fetch", "gsm8k", "--ouput", "x"],
            "error: posttrain data fetch: unknown flag --ouput: did you mean --output?",
        ),
        (["run"], "error: posttrain run: the following arguments are required: config"),
        (["compare", "--last", "0"], "error: posttrain compare: argument --last: must be at least 1, got 0"),
        (
            ["rewards", "check", "c.yaml", "--references", "-1"],
            "error: posttrain rewards check: argument --references: must be at least 0, got -1",
        ),
        (
            ["data", "preview", "d.jsonl", "-n", "-2"],
            "error: posttrain data preview: argument -n: must be at least 1, got -2",
        ),
        (
            ["eval", "--diff", "a", "b", "--examples", "x"],
            "error: posttrain eval: argument --examples: not a whole number: 'x'",
        ),
    ],
    ids=[
        "renamed",
        "misspelt",
        "bad choice",
        "extra argument",
        "subcommand's flag",
        "missing argument",
        "no runs to compare",
        "negative references",
        "negative examples to show",
        "a count that is not a number",
    ],  # fmt: skip
)
def test_a_bad_command_line_is_one_line_exit_2(argv, line, isolated, capfd):
    """argparse's own error prints the usage first (four lines); a renamed flag gets its new name and a
    misspelt one the closest, as a renamed or misspelt config key does."""
    before = _tree(isolated)
    code = main([*argv, "--output", "out"] if argv[0] == "eval" else argv)
    out, err = capfd.readouterr()
    assert code == 2 and out == ""
    assert err.splitlines() == [line]
    assert _tree(isolated) == before


def test_an_error_found_inside_a_step_is_one_line_without_prefects_tracebacks(isolated, capfd):
    """Only the data step can see that too few records are left for the held-out slice: the error
    crosses Prefect's task and flow, which would each print the traceback first; the user sees
    posttrain's line, and the runs say FAILED. (A malformed line is found before anything starts:
    the "malformed local data line" case of the table.)"""
    import sqlite3

    tmp = isolated
    (tmp / "two.jsonl").write_text(
        '{"question": "q?", "answer": "so #### 4"}\n{"question": "q2?", "answer": "so #### 5"}\n'
    )
    cfg = tmp / "few.yaml"
    cfg.write_text(
        "model: {name: tiny-random, precision: fp32}\ndata: {source: local, path: two.jsonl, eval_size: 2}\n"
        f"tracking: {{log_model: false, tracking_uri: 'sqlite:///{tmp / 'mlflow.db'}'}}\n"
        f"orchestration: {{store: {tmp / 'store'}}}\n"
    )
    code = main(["run", str(cfg), "--set", f"model.cache_dir={tmp / 'models'}"])
    err = capfd.readouterr().err
    assert code == 2
    assert [line for line in err.splitlines() if "error:" in line.lower()] == [
        "error: data.eval_size=2 but only 2 records are left for it; the held-out slice must leave at least "
        "one training record (lower eval_size or load more data)"
    ]
    assert "Traceback" not in err and "Encountered exception" not in err
    statuses = set(sqlite3.connect(tmp / "mlflow.db").execute("select status from runs"))
    assert statuses == {("FAILED",)}


# --------------------------------------------------------------------------- eval's own inputs


def test_eval_output_naming_a_file_fails_before_the_evaluation(isolated, capfd, monkeypatch):
    import posttrain.evaluation

    def evaluated(*args, **kwargs):
        raise AssertionError("the evaluation ran before --output was checked")

    monkeypatch.setattr(posttrain.evaluation, "run_eval", evaluated)
    code = main(["eval", "--model", "tiny-random", "--data", "synthetic", "--output", "afile"])
    err = capfd.readouterr().err
    assert code == 2
    assert err.strip() == "error: --output afile: is a file; give a folder for report.json and examples.jsonl"


@pytest.mark.parametrize(
    ("flag", "value", "fragment"),
    [
        ("--data", "/dev/zero", "error: --data: /dev/zero is a character device"),
        ("--model", "/dev/null", "error: --model: /dev/null is a character device"),
    ],
)
def test_eval_refuses_a_device_before_reading_it(flag, value, fragment, isolated, capfd):
    argv = {"--model": "tiny-random", "--data": "synthetic", flag: value}
    code = main(["eval", *[x for kv in argv.items() for x in kv]])
    assert code == 2 and capfd.readouterr().err.strip().startswith(fragment)


def _report(folder: Path) -> Path:
    from posttrain.evaluation.report import EvalReport

    return EvalReport(model="m", summary={"accuracy_strict": 1.0}, records=()).save(folder)


REPORT_DAMAGE = [
    ("report.json", "a string", '"not a report"', "report.json: not a JSON object"),
    ("report.json", "truncated", '{"model": "m", "summ', "report.json: malformed JSON"),
    ("report.json", "nested", "[" * DEEP + "]" * DEEP, "report.json: nested deeper than 64 levels"),
    ("report.json", "fields", '{"model": 1, "summary": []}', "report.json: not an evaluation report"),
    (
        "report.json",
        "another format",
        '{"format_version": 99, "model": "m", "summary": {}}',
        "report.json: format_version 99; this posttrain reads 1",
    ),
    ("examples.jsonl", "a bad line", '{"id": "q1"}\n{"id": ', "examples.jsonl:2: malformed JSON"),
    ("examples.jsonl", "not UTF-8", b"\xff\xfe", "examples.jsonl:1: not UTF-8 text"),
]


@pytest.mark.parametrize(
    ("file", "content", "fragment"),
    [(f, c, m) for f, _, c, m in REPORT_DAMAGE],
    ids=[d[1] for d in REPORT_DAMAGE],
)
def test_eval_diff_on_a_damaged_report_is_one_line(file, content, fragment, isolated, capfd):
    a, b = _report(isolated / "a"), _report(isolated / "b")
    path = b / file
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    code = main(["eval", "--diff", str(a), str(b)])
    err = capfd.readouterr().err
    assert code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: {b}/") and fragment in err


@pytest.mark.parametrize("flag", ["--model", "--data", "--output", "--limit"])
def test_eval_diff_refuses_an_evaluations_flag_it_would_ignore(flag, isolated, capfd):
    a, b = _report(isolated / "a"), _report(isolated / "b")
    assert main(["eval", "--diff", str(a), str(b), flag, "1"]) == 2
    err = capfd.readouterr().err.strip()
    assert err == f"error: eval --diff compares two reports; {flag} applies to an evaluation"


def test_eval_diff_on_a_file_is_one_line(isolated, capfd):
    a = _report(isolated / "a")
    assert main(["eval", "--diff", str(a), "afile"]) == 2
    assert capfd.readouterr().err.strip() == "error: --diff: afile is a file, not a folder"


# --------------------------------------------------------------------------- the last line of defence


def _sqlite_disk_full() -> Exception:
    """What a full disk under MLflow's SQLite store raises: MLflow's error from SQLAlchemy's from sqlite3's."""
    import sqlite3

    import sqlalchemy.exc
    from mlflow.exceptions import MlflowException

    try:
        try:
            try:
                raise sqlite3.OperationalError("database or disk is full")
            except sqlite3.OperationalError as exc:
                raise sqlalchemy.exc.OperationalError("INSERT INTO metrics", {}, exc) from exc
        except sqlalchemy.exc.OperationalError as exc:
            raise MlflowException(f"(sqlite3.OperationalError) {exc.orig}") from exc
    except MlflowException as exc:
        return exc


def _safetensors_disk_full() -> Exception:
    from safetensors import SafetensorError

    return SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


LIBRARY_ERRORS = [
    (
        "disk full under SQLite (MLflow)",
        _sqlite_disk_full,
        "error: the MLflow database (SQLite): database or disk is full",
    ),
    (
        "disk full under safetensors",
        _safetensors_disk_full,
        "error: saving weights (safetensors): Error while serializing",
    ),
    (
        "disk full",
        lambda: OSError(28, "No space left on device", "/store/stages/x"),
        "error: /store/stages/x: No space left on device",
    ),
    (
        "permission",
        lambda: PermissionError(13, "Permission denied", "/store/lock"),
        "error: /store/lock: Permission denied",
    ),
    (
        "name too long",
        lambda: OSError(36, "File name too long", "/store/" + "s" * 300),
        "error: /store/" + "s" * 300 + ": File name too long",
    ),
    (
        "not UTF-8",
        lambda: UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"),
        "error: input is not UTF-8 text",
    ),
    (
        "recursion",
        lambda: RecursionError("maximum recursion depth exceeded"),
        "error: input nested too deeply",
    ),
]


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
@pytest.mark.parametrize(
    ("make", "fragment"), [c[1:] for c in LIBRARY_ERRORS], ids=[c[0] for c in LIBRARY_ERRORS]
)
def test_errors_a_user_causes_deep_in_a_library_are_one_line(
    make, fragment, debug, isolated, capfd, monkeypatch
):
    """Raised from inside a command (as a save or a tracking call would): one line and exit 2; the
    traceback only with --debug, before the line."""
    import posttrain.cli

    error = make()

    def command(args):
        raise error

    monkeypatch.setattr(posttrain.cli, "cmd_rewards_list", command)
    code = main([*(["--debug"] if debug else []), "rewards", "list"])
    err = capfd.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and lines[-1].startswith(fragment), err
    assert ("Traceback" in err) is debug and (len(lines) == 1) is not debug


def test_an_error_no_user_can_cause_keeps_its_traceback(isolated, monkeypatch):
    import posttrain.cli

    def command(args):
        raise KeyError("a bug")

    monkeypatch.setattr(posttrain.cli, "cmd_rewards_list", command)
    with pytest.raises(KeyError):
        main(["rewards", "list"])


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["data", "fetch", "gsm8k", "--dir", "notes.txt"],
            "error: --dir notes.txt: notes.txt is a file, not a folder",
        ),
        (
            ["data", "fetch", "gsm8k", "--output", "notes.txt/x/train.jsonl"],
            "error: --output notes.txt/x/train.jsonl: notes.txt is a file, not a folder",
        ),
        (
            ["data", "fetch", "gsm8k", "--split", "validation"],
            "error: posttrain data fetch: argument --split: invalid choice: 'validation' (choose from 'train', 'test')",
        ),
        (
            ["data", "preview", "three.jsonl", "--set", "data.eval_size=1"],
            "error: --set applies to a config; three.jsonl is data (preview a config to set its keys)",
        ),
        (
            ["data", "preview", "three.jsonl"],
            "error: three.jsonl: data.eval_size=100 but only 3 records are left",
        ),
        (
            ["eval", "--model", "./no-model", "--data", "synthetic"],
            "error: --model: no such file or folder: ./no-model",
        ),
        (
            ["eval", "--model", "tiny-random", "--data", "empty.jsonl"],
            "error: empty.jsonl: no evaluation records",
        ),
        (
            ["eval", "--model", "Qwen/Qwen2.5-0.5B-Instruct", "--data", "empty.jsonl"],
            "error: empty.jsonl: no evaluation records",  # a hub id is not taken for a missing path
        ),
        (
            ["data", "hold-out", "three.jsonl", "--last", "1", "--train", "a.jsonl", "--test", "out"],
            "error: --test out is a folder",
        ),
        (
            ["data", "fetch", "gsm8k"],
            "error: GSM8K_DIR=notes.txt/gsm8k: notes.txt is a file, not a folder",
        ),
        (
            ["models", "list", "--cache-dir", "notes.txt"],
            "error: --cache-dir notes.txt is a file, not a folder",
        ),
        (
            ["models", "pull", "tiny-random", "--cache-dir", "notes.txt"],
            "error: --cache-dir notes.txt is a file",
        ),
        (["config", "grpo..stages"], "error: config: no section or key 'grpo..stages'"),
        (["config", ""], "error: config: no section or key ''"),
    ],
    ids=[
        "fetch into a file",
        "fetch under a file",
        "fetch a split GSM8K lacks",
        "preview a file with --set",
        "preview a small file",
        "a local model that is not there",
        "an empty evaluation file",
        "a hub id",
        "hold out into a folder",
        "fetch into GSM8K_DIR under a file",
        "models list in a file",
        "models pull into a file",
        "a key with an empty part",
        "an empty key",
    ],  # fmt: skip
)
def test_data_and_eval_commands_name_the_flag_or_file_before_the_hub_or_a_model(
    argv, line, isolated, capfd, monkeypatch
):
    """Each is known from the command line alone: asking the hub first costs half a minute of
    retries offline, and a line that names neither the file nor the flag leaves the user guessing."""
    (isolated / "notes.txt").write_text("notes\n")
    (isolated / "three.jsonl").write_text('{"question": "q?", "answer": "#### 1"}\n' * 3)
    (isolated / "empty.jsonl").write_text("")
    (isolated / "out").mkdir()
    if argv == ["data", "fetch", "gsm8k"]:
        monkeypatch.setenv("GSM8K_DIR", "notes.txt/gsm8k")
    before = _tree(isolated)
    code = main(argv)
    out, err = capfd.readouterr()
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and err.startswith(line), err
    assert _tree(isolated) == before


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("store under a file", "{cfg}: orchestration.store: {tmp}/afile is not a folder"),
        ("a folder holding only data/ and results/ is not a store", None),
        ("a store whose stages/ links outside it", None),
    ],
)
def test_a_dry_run_refuses_the_store_a_run_would_refuse_and_writes_nothing(case, fragment, isolated, capfd):
    """A dry run answers "would this run?": a plan printed for a store the run refuses says yes wrongly."""
    _, sets, _, _, _, setup, run_fragment = next(c for c in ALL_CASES if c[0] == case)
    cfg = isolated / "bad.yaml"
    cfg.write_text(BASE)
    if setup is not None:
        setup(isolated)
    before = _tree(isolated)
    overrides = [s.replace("{tmp}", str(isolated)) for s in sets]
    assert main(["run", str(cfg), *[a for s in overrides for a in ("--set", s)], "--dry-run"]) == 2
    out, err = capfd.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert (fragment or run_fragment).format(cfg=cfg, tmp=isolated) in err
    assert _tree(isolated) == before
