"""What a user hands posttrain, checked before anything reads it (core/inputs.py) and what a config
points at (pipeline/input_checks.py). The CLI-level cases are in tests/integration/test_bad_inputs.py."""

from __future__ import annotations

import os

import pytest

from posttrain.core.errors import ConfigError
from posttrain.core.inputs import (
    MAX_YAML_NODES,
    YAMLLimitError,
    _expanded_nodes,
    check_config_values,
    load_yaml_bounded,
    path_problem,
)
from posttrain.pipeline.input_checks import tracking_uri_problem


def test_path_kinds(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "f").write_text("x")
    assert path_problem(fifo) == "is a FIFO (named pipe), not a regular file or folder"
    assert path_problem("/dev/null") == "is a character device, not a regular file or folder"
    assert path_problem(tmp_path / "f", "folder") == "is a file, not a folder"
    assert path_problem(tmp_path, "file") == "is a folder, not a file"
    assert path_problem(tmp_path / "nope") == "no such file or folder"
    assert path_problem(tmp_path / "f") is None and path_problem(tmp_path) is None


@pytest.mark.parametrize(
    ("text", "count"),
    [
        ("a: 1", 3),  # the mapping, its key, its value
        ("a: &x [1, 2]\nb: *x", 1 + 1 + 3 + 1 + 3),  # the alias counts as the list it names
        ("a: &x [1, 1]\nb: &y [*x, *x]\nc: [*y, *y]", 1 + (1 + 3) + (1 + 7) + (1 + 15)),
    ],
)
def test_alias_expansion_is_counted_on_the_node_graph(text, count):
    import yaml

    assert _expanded_nodes(yaml.compose(text), 10**9) == count


def test_an_alias_bomb_is_refused_before_anything_is_built(monkeypatch):
    import yaml

    built = []
    real = yaml.SafeLoader.construct_document
    monkeypatch.setattr(
        yaml.SafeLoader, "construct_document", lambda self, node: built.append(1) or real(self, node)
    )
    bomb = "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]\n" for i in range(1, 8)
    )
    assert len(bomb) < 1000
    with pytest.raises(YAMLLimitError, match=f"expands to more than {MAX_YAML_NODES:,} values"):
        load_yaml_bounded(bomb, "bomb.yaml")
    assert built == []
    assert load_yaml_bounded("a: &x [1]\nb: *x", "ok.yaml") == {"a": [1], "b": [1]}


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("a: " + "[" * 40 + "]" * 40, r"x.yaml:1: nested deeper than 32 levels"),
        ("a:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 40)), r"x.yaml:\d+: nested deeper"),
        ("a: [", r"x.yaml:1: invalid YAML"),
        ("#" * (1 << 21), r"x.yaml: larger than 1024 KiB"),
    ],
)
def test_yaml_limits(text, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_yaml_bounded(text, "x.yaml")


def _deep(n):
    value = 1
    for _ in range(n):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("raw", "pattern"),
    [
        ({"a": [{"b": float("inf")}]}, "c.yaml: a.0.b: must be a finite number, got inf"),
        ({"a": -1e16}, "c.yaml: a: -1e\\+16 is beyond any sensible setting"),
        ({"a": {"b": {"c": None}}} | {"d": _deep(40)}, "c.yaml: nested deeper than 32 levels"),
    ],
)
def test_config_values_are_finite_bounded_and_shallow(raw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        check_config_values(raw, "c.yaml")


@pytest.mark.parametrize(
    ("uri", "problem"),
    [
        ("sqlite:///mlflow.db", None),
        ("sqlite:////abs/mlflow.db", None),
        ("http://127.0.0.1:5000", None),
        ("postgresql+psycopg2://u:p%40ss@db:5432/mlflow", None),
        ("databricks", None),
        ("file:///tmp/mlruns", None),
        ("mlruns", None),
        ("gopher://host/x", "gopher is not a tracking store MLflow knows"),
        ("https:///no-host", "https needs a host"),
        ("sqlite:mlflow.db", "a SQLite URI is sqlite:///"),
        ("http://u:p/w@host:5000", "not a URI"),  # a raw '/' in the password: no parser finds the host
    ],
)
def test_tracking_uri_forms(uri, problem):
    found = tracking_uri_problem(uri)
    assert (found is None) if problem is None else (problem in found), found
