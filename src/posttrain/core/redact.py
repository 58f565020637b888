"""Secrets out of everything posttrain writes or logs: MLflow params, tags and artifacts, ``stage.json``,
console lines, every log record (:func:`redacting_log_records`) and Prefect's flow-run parameters.
This is the one redaction function: every URI posttrain shows and every log line goes through it.

Two rules, applied to nested mappings and lists:

* a value under a secret-looking key (``password``, ``secret``, ``api_key``, ``hub_token``,
  ``access_token``, ``credentials``, ...) becomes :data:`REDACTED`, whatever it is;
* in any string, the password of a URI (``scheme://user:password@host``), secret-looking query
  parameters (``?token=...``) and Hugging Face tokens (``hf_...``) are replaced by :data:`REDACTED`.
  A password runs to the *last* ``@`` of the URI, so one holding ``@``, ``:``, ``/`` or
  percent-escapes is hidden whole (a URI parser would disagree on where it ends; the redaction
  errs towards hiding more).

Tokenizer settings are not secrets: ``pad_token``, ``eos_token``, ``max_new_tokens`` and the like
are kept.

>>> redact({"trainer": {"hub_token": "hf_abc", "pad_token": "<pad>", "max_new_tokens": 8}})
{'trainer': {'hub_token': '***', 'pad_token': '<pad>', 'max_new_tokens': 8}}
>>> redact_text("http://alice:s3cret@mlflow.local:5000/?token=abc&x=1")
'http://alice:***@mlflow.local:5000/?token=***&x=1'
>>> redact_text("postgresql://bob:p@ss:w/rd%21@db:5432/mlflow")
'postgresql://bob:***@db:5432/mlflow'
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import yaml

__all__ = [
    "REDACTED",
    "RedactingFormatter",
    "is_secret_key",
    "redact",
    "redact_override",
    "redact_text",
    "redacting_log_records",
]

REDACTED = "***"
_SECRET_WORDS = r"password|passwd|passphrase|pwd|secret|credentials?|api[_-]?key|apikey|access[_-]?key|private[_-]?key|auth"
_SECRET_KEY = re.compile(rf"(^|[_\-.])({_SECRET_WORDS})($|[_\-.])", re.IGNORECASE)
_TOKEN_KEY = re.compile(r"(^|[_\-.])token$", re.IGNORECASE)
# `<word>_token` keys that name a vocabulary entry, not a credential.
_TOKENIZER_WORDS = {"pad", "eos", "bos", "unk", "sep", "cls", "mask", "start", "end", "stop", "special"}
# userinfo = user ":" password "@": the password is greedy up to the last "@" of the URI (the host
# part after it holds none), so "@", ":" and "/" inside it are hidden too.
_URI_PASSWORD = re.compile(
    r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^\s/:@'\"]*:)(?P<secret>[^\s'\"]+)(?P<tail>@[^\s@'\"]*)"
)
_QUERY_SECRET = re.compile(
    rf"(?P<head>[?&;](?:[^\s=&;#]*[_\-.])?(?:{_SECRET_WORDS}|token|access_token|sig|signature)=)(?P<secret>[^\s&;#]+)",
    re.IGNORECASE,
)
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{20,}\b")


def is_secret_key(key: Any) -> bool:
    """Whether a mapping key names a credential.

    >>> [k for k in ("hub_token", "token", "api_key", "password", "pad_token", "max_tokens") if is_secret_key(k)]
    ['hub_token', 'token', 'api_key', 'password']
    """
    if not isinstance(key, str):
        return False
    if _SECRET_KEY.search(key):
        return True
    if _TOKEN_KEY.search(key):
        prefix = re.split(r"[_\-.]", key.lower()[: -len("token")].rstrip("_-."))[-1]
        return prefix not in _TOKENIZER_WORDS
    return False


def redact_text(text: str) -> str:
    """``text`` with URI passwords, secret query parameters and Hugging Face tokens replaced."""
    if not isinstance(text, str):
        return text
    text = _URI_PASSWORD.sub(rf"\g<head>{REDACTED}\g<tail>", text)
    text = _QUERY_SECRET.sub(rf"\g<head>{REDACTED}", text)
    return _HF_TOKEN.sub(REDACTED, text)


def redact(value: Any) -> Any:
    """A copy of ``value`` (mappings, lists, tuples, strings) with secrets replaced (module docstring)."""
    if isinstance(value, Mapping):
        return {k: (REDACTED if is_secret_key(k) and v is not None else redact(v)) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(redact(v) for v in value)
    if isinstance(value, str):
        return redact_text(value)
    return value


def redact_override(override: str) -> str:
    """A ``--set``-style ``dotted.key=value`` override without secrets: the value of a secret-looking
    key, secrets inside a mapping value, and passwords in URIs are replaced.

    >>> redact_override("grpo.stages.0.rewards.0.params.api_key=abc123")
    'grpo.stages.0.rewards.0.params.api_key=***'
    >>> redact_override("tracking.tracking_uri=http://bob:pw@mlflow:5000")
    'tracking.tracking_uri=http://bob:***@mlflow:5000'
    >>> redact_override("grpo.stages.0.rewards.0.params={api_key: abc, n: 2}")
    'grpo.stages.0.rewards.0.params={"api_key": "***", "n": 2}'
    >>> redact_override("seed=1")
    'seed=1'
    """
    key, sep, value = override.partition("=")
    if not sep:
        return redact_text(override)
    if is_secret_key(key.strip().rsplit(".", 1)[-1]):
        return f"{key}={REDACTED}"
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        parsed = None
    if isinstance(parsed, dict | list) and (cleaned := redact(parsed)) != parsed:
        return f"{key}={json.dumps(cleaned, default=str)}"
    return f"{key}={redact_text(value)}"


class RedactingFormatter(logging.Formatter):
    """A formatter whose every line (message, traceback, stack) passes through :func:`redact_text`."""

    def format(self, record: logging.LogRecord) -> str:
        return redact_text(super().format(record))


@contextmanager
def redacting_log_records() -> Iterator[None]:
    """Within the block, every log record is created with its message already redacted, whichever
    handler gets it (the console, Prefect's API handler, a file): the message is formatted once at
    creation, and replaced (its arguments dropped) only when it held a secret."""
    previous: Callable[..., logging.LogRecord] = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is the logging module's to report, as usual
            return record
        cleaned = redact_text(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        return record

    logging.setLogRecordFactory(factory)
    try:
        yield
    finally:
        logging.setLogRecordFactory(previous)
