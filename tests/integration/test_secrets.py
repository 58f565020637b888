"""Secrets never reach disk or logs (issue 29, class 2).

One `posttrain run` (data, baseline evaluation, one GRPO step, its evaluation; MLflow on SQLite,
Prefect's embedded server, a shared store) whose config, overrides and environment hold a planted
secret in every place a user can put one: a custom reward's params (a secret-looking key, a URI
password and an hf_ token in plain ones), a --set override, the shared store's URL, and the
credentials MLflow, the hub and object stores read from the environment. (A trainer option cannot
hold one: transformers logs those to MLflow as they are, so they are refused; see the
"credential in a trainer option" case of tests/integration/test_bad_inputs.py.) Afterwards every file the
run wrote (the store with its records, stage outputs and Prefect database, mlflow.db and MLflow's
artifacts, the remembered option checks) and everything it printed or logged is searched for each
secret, byte for byte: none may appear.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.core.library_policy import CUSTOM_CODE_ENV

SECRETS = {
    "param": "PLANTEDparamKEY1",  # params.api_key: a secret-looking key
    "uri": "PLANTEDuri@pw:/%40",  # a URI password (with the characters that broke redaction)
    "override": "PLANTEDoverrideKEY2",  # --set ...params.token=
    "shared": "PLANTEDshared@pw",  # orchestration.shared_store's password
    "hf": "hf_PLANTEDhfTOKEN0123456789abcd",  # HF_TOKEN, and an hf_ token in a param
    "env": "PLANTEDenvSECRET3",  # MLflow and object-store credentials in the environment
}
NEEDLES = [
    "PLANTEDparam",
    "PLANTEDuri",
    "PLANTEDoverride",
    "PLANTEDshared",
    "PLANTEDhf",
    "PLANTEDenv",
]

REWARD_MODULE = '''
def make_planted_reward(api_key, endpoint, note="", token=""):
    """A reward factory whose params hold credentials, as a reward calling an API would."""

    def planted_reward(completions, **kwargs):
        return [0.0 for _ in completions]

    return planted_reward
'''

CONFIG = f"""\
name: secrets
model: {{name: tiny-random, precision: fp32, lora: {{r: 4, alpha: 8}}}}
data: {{source: synthetic, synthetic: {{num_examples: 24}}, eval_size: 4, max_prompt_tokens: 1024}}
grpo:
  stages:
    - name: s
      rewards:
        - name: planted_reward_module:make_planted_reward
          params:
            api_key: {SECRETS["param"]}
            endpoint: "https://svc:{SECRETS["uri"]}@api.example.com/v1"
            note: "use {SECRETS["hf"]} for the hub"
        - {{name: xml_count}}
      trainer: {{max_steps: 1, num_generations: 2, per_device_train_batch_size: 2, max_completion_length: 8,
                save_strategy: "no"}}
eval: {{limit: 2, max_completion_length: 4, batch_size: 2}}
tracking: {{log_model: false}}
"""


def _files(*roots: Path) -> list[Path]:
    found = []
    for root in roots:
        for top, _, names in os.walk(root):
            found += [Path(top, n) for n in names if not Path(top, n).is_symlink()]
    return found


@pytest.fixture(scope="module")
def secret_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("secrets")
    (tmp / "planted_reward_module.py").write_text(REWARD_MODULE)
    (tmp / "c.yaml").write_text(CONFIG)
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(self.format(record))

    keep = Keep(logging.DEBUG)
    with pytest.MonkeyPatch.context() as env:
        env.chdir(tmp)
        env.syspath_prepend(str(tmp))
        env.setenv("POSTTRAIN_CACHE", str(tmp / "cache"))
        env.setenv(CUSTOM_CODE_ENV, "1")  # the custom reward (a place a secret goes) needs it
        env.setenv("HF_TOKEN", SECRETS["hf"])
        env.setenv("MLFLOW_TRACKING_PASSWORD", SECRETS["env"])
        env.setenv("MLFLOW_TRACKING_TOKEN", SECRETS["env"])
        env.setenv("AWS_SECRET_ACCESS_KEY", SECRETS["env"])
        env.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.5")
        env.delenv("MLFLOW_TRACKING_URI", raising=False)
        env.delenv("PREFECT_API_URL", raising=False)
        root = logging.getLogger()
        level = root.level
        root.addHandler(keep)
        root.setLevel(logging.INFO)
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
                code = main(
                    [
                        "run",
                        str(tmp / "c.yaml"),
                        "--set",
                        f"grpo.stages.0.rewards.0.params.token={SECRETS['override']}",
                        "--set",
                        f"orchestration.shared_store=memory://team:{SECRETS['shared']}@bucket/posttrain",
                        "--set",
                        f"tracking.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
                        "--set",
                        f"orchestration.store={tmp / 'store'}",
                        "--set",
                        f"model.cache_dir={tmp / 'models'}",
                    ]
                )
        finally:
            root.removeHandler(keep)
            root.setLevel(level)
    return tmp, code, [*records, printed.getvalue()]


def test_the_run_used_every_planted_secret(secret_run):
    tmp, code, _ = secret_run
    assert code == 0
    assert (tmp / "mlflow.db").is_file() and list((tmp / "store" / "results").iterdir())
    assert list((tmp / "cache" / "checked-options").iterdir())  # the option checks were remembered
    stage = next((tmp / "store" / "stages").glob("grpo-s-*"))
    assert "api.example.com" in (stage / "stage.json").read_text()  # the params reached stage.json


def test_no_file_the_run_wrote_holds_a_secret(secret_run):
    tmp, _, _ = secret_run
    prefect_home = Path(os.environ.get("PREFECT_HOME", tmp / "store" / "prefect"))
    files = _files(tmp / "store", tmp / "cache", tmp / "mlruns", tmp / "mlartifacts", prefect_home)
    files += [tmp / "mlflow.db", *tmp.glob("mlflow.db-*")]
    assert len(files) > 20
    leaks = [
        f"{path}: {needle}"
        for path in files
        if path.is_file()
        for needle in NEEDLES
        if needle.encode() in path.read_bytes()
    ]
    assert leaks == []


def test_nothing_it_printed_or_logged_holds_a_secret(secret_run):
    _, _, records = secret_run
    assert any("memory://team:***@bucket/posttrain" in r for r in records)  # the URL, redacted
    leaks = [r for r in records for needle in NEEDLES if needle in r]
    assert leaks == []
