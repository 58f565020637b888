"""Secret-looking keys and credentials in URIs are redacted wherever posttrain writes a config."""

from __future__ import annotations

import json

import pytest

from posttrain.core.config import dump_config, parse_config
from posttrain.core.redact import REDACTED, is_secret_key, redact, redact_text


@pytest.mark.parametrize(
    ("key", "secret"),
    [
        ("hub_token", True),
        ("token", True),
        ("access_token", True),
        ("api_key", True),
        ("apiKey", True),
        ("password", True),
        ("db_password", True),
        ("client_secret", True),
        ("credentials", True),
        ("aws_secret_access_key", True),
        ("pad_token", False),  # tokenizer vocabulary, not a credential
        ("eos_token", False),
        ("max_new_tokens", False),
        ("max_prompt_tokens", False),
        ("author", False),
        ("cache_key", False),
    ],
)
def test_secret_keys(key, secret):
    assert is_secret_key(key) is secret


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("http://alice:pw@host:5000/api", f"http://alice:{REDACTED}@host:5000/api"),
        ("postgresql+psycopg://u:p%40ss@db/mlflow", f"postgresql+psycopg://u:{REDACTED}@db/mlflow"),
        ("https://host/x?token=abc&page=2", f"https://host/x?token={REDACTED}&page=2"),
        ("https://host/x?api_key=abc", f"https://host/x?api_key={REDACTED}"),
        ("use hf_" + "a" * 30 + " here", f"use {REDACTED} here"),
        ("sqlite:///tmp/mlflow.db", "sqlite:///tmp/mlflow.db"),  # nothing to hide
        ("http://host:5000/", "http://host:5000/"),
    ],
)
def test_credentials_in_text(text, expected):
    assert redact_text(text) == expected


def test_nested_values_under_secret_keys_go_whole():
    assert redact({"auth": {"user": "u", "password": "p"}, "keep": [1, "x"]}) == {
        "auth": REDACTED,
        "keep": [1, "x"],
    }


def test_a_configs_json_form_is_redacted_and_its_objects_are_not():
    cfg = parse_config(
        {
            "name": "c",
            "model": {"name": "tiny-random"},
            "tracking": {"tracking_uri": "http://u:topsecret@127.0.0.1:5000"},
            "grpo": {
                "stages": [{"name": "s", "rewards": [{"name": "m:f", "params": {"api_key": "topsecret"}}]}]
            },
        }
    )
    assert "topsecret" not in json.dumps(cfg.model_dump(mode="json"))
    assert "topsecret" not in dump_config(cfg)  # config.yaml
    assert cfg.tracking.tracking_uri == "http://u:topsecret@127.0.0.1:5000"  # what the tracker uses
    assert cfg.grpo.stages[0].rewards[0].params == {"api_key": "topsecret"}  # what the reward gets


def test_stage_json_and_mlflow_params_are_redacted(tmp_path):
    from posttrain.models.artifacts import read_stage_json, write_stage_json
    from posttrain.tracking.mlflow_io import flatten_params

    write_stage_json(
        tmp_path,
        stage="sft",
        kind="sft",
        config={"trainer": {"hub_model_id": "me/m"}},
        config_hash="h",
        model_config_hash="m",
        input_model="/m",
        input_fingerprint="f",
        data_fingerprint="d",
        seed=0,
        precision="fp32",
        metrics={},
        alerts=[],
        samples=[],
        artifact="full",
        adapter=None,
        duration_s=1.0,
        extra={"trainer_options": {"hub_token": "topsecret"}},
    )
    assert read_stage_json(tmp_path)["trainer_options"] == {"hub_token": REDACTED}
    assert flatten_params({"x": {"password": "topsecret", "uri": "http://a:topsecret@h"}}) == {
        "x.password": REDACTED,
        "x.uri": f"http://a:{REDACTED}@h",
    }


@pytest.mark.parametrize(
    "password",
    ["p@ss", "p:ss", "p/ss", "p%40ss%3A", "a@b:c/d%2F@e", "@", ":@/"],
)
@pytest.mark.parametrize(
    "uri",
    [
        "http://alice:{pw}@mlflow.local:5000/api",  # MLflow
        "postgresql+psycopg2://alice:{pw}@db:5432/mlflow",
        "http://alice:{pw}@127.0.0.1:4200/api",  # Prefect
        "s3://alice:{pw}@bucket/posttrain",  # a shared store
    ],
)
def test_a_password_holding_at_colon_slash_or_escapes_is_hidden_whole(uri, password):
    text = "connecting to " + uri.format(pw=password) + ": refused"
    assert redact_text(text) == "connecting to " + uri.format(pw=REDACTED) + ": refused"


def test_every_log_record_is_redacted_whatever_its_handler(caplog):
    import logging

    from posttrain.core.redact import RedactingFormatter, redacting_log_records

    log = logging.getLogger("posttrain.test_redact")
    with caplog.at_level(logging.INFO):
        with redacting_log_records():
            log.info("pushed to %s", "s3://u:p@ss/w@bucket/x")
            log.info("token %s", "hf_" + "b" * 30)
        log.info("after the block: %s", "http://u:pw@h")  # the factory is restored
    assert [r.getMessage() for r in caplog.records] == [
        f"pushed to s3://u:{REDACTED}@bucket/x",
        f"token {REDACTED}",
        "after the block: http://u:pw@h",
    ]
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed: %s", ("http://u:pw@h",), None)
    assert RedactingFormatter("%(message)s").format(record) == f"failed: http://u:{REDACTED}@h"
