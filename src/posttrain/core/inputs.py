"""What a user hands posttrain, checked before anything reads it: paths and YAML text.

**Paths.** A path a config or a flag names (the config itself, local data, an accelerate config, a
model folder or ``.gguf`` file) must be a regular file or a folder. Reading a FIFO blocks until
someone writes to it and a device never ends, so either would hang a run that looks busy; both are
refused by :func:`check_input_path` with the key that named them.

**YAML.** A config is small. :func:`load_yaml_bounded` refuses, before building any Python object,
a file larger than :data:`MAX_YAML_BYTES`, nesting deeper than :data:`MAX_YAML_DEPTH` (PyYAML's
composer recurses: thousands of levels end in a RecursionError) and a document whose aliases expand
to more than :data:`MAX_YAML_NODES` nodes: an "alias bomb" of a few hundred bytes names one list
from ten others, nine times over, and expands to millions of values once anything walks it
(validation, hashing, the remembered checks). The expanded size is counted on the node graph, each
node once, so the check costs the size of the text, not of the expansion.
"""

from __future__ import annotations

import math
import stat
from pathlib import Path
from typing import Any, Literal

import yaml

from posttrain.core.errors import ConfigError
from posttrain.core.untrusted import check_depth

__all__ = [
    "MAX_YAML_BYTES",
    "MAX_YAML_DEPTH",
    "MAX_YAML_NODES",
    "YAMLLimitError",
    "check_config_values",
    "check_input_path",
    "file_in_the_way",
    "load_yaml_bounded",
    "path_problem",
]

MAX_YAML_BYTES = 1 << 20
MAX_YAML_DEPTH = 32
MAX_YAML_NODES = 100_000

Kind = Literal["file", "folder", "any"]


class YAMLLimitError(ConfigError):
    """YAML text beyond :data:`MAX_YAML_BYTES`, :data:`MAX_YAML_DEPTH` or :data:`MAX_YAML_NODES`."""


class _TooDeep(Exception):
    def __init__(self, line: int) -> None:
        self.line = line


def path_problem(path: str | Path, want: Kind = "any") -> str | None:
    """Why ``path`` cannot be read as ``want`` (None when it can): missing, a FIFO, a socket, a
    device, a file where a folder is wanted or the reverse.

    >>> path_problem("/dev/null"), path_problem("/"), path_problem("/", "file")
    ('is a character device, not a regular file or folder', None, 'is a folder, not a file')
    """
    try:
        mode = Path(path).expanduser().stat().st_mode
    except FileNotFoundError:
        return "no such file or folder"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISDIR(mode):
        return "is a folder, not a file" if want == "file" else None
    if stat.S_ISREG(mode):
        return "is a file, not a folder" if want == "folder" else None
    kind = (
        "a FIFO (named pipe)"
        if stat.S_ISFIFO(mode)
        else "a socket"
        if stat.S_ISSOCK(mode)
        else "a character device"
        if stat.S_ISCHR(mode)
        else "a block device"
        if stat.S_ISBLK(mode)
        else "not a regular file"
    )
    return f"is {kind}, not a regular file or folder"


def file_in_the_way(path: str | Path) -> Path | None:
    """The file standing where ``path`` or a folder above it would have to be a folder (an output
    folder ``notes.txt/out`` under a file ``notes.txt``), or None: found before anything is written.

    >>> file_in_the_way("/dev/null/out"), file_in_the_way("/tmp/any/new/folder")
    (PosixPath('/dev/null'), None)
    """
    path = Path(path).expanduser()
    return next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)


def check_input_path(path: str | Path, key: str, want: Kind = "any") -> Path:
    """``path`` (user-expanded) if it is a readable ``want``, else a ConfigError naming ``key``."""
    problem = path_problem(path, want)
    if problem is not None:
        if problem == "no such file or folder":
            raise ConfigError(f"{key}: no such file or folder: {path} (from {Path.cwd()})")
        raise ConfigError(f"{key}: {path} {problem}")
    return Path(path).expanduser()


class _BoundedComposer(yaml.SafeLoader):
    """A SafeLoader whose composer refuses deep nesting as it goes (before Python's recursion limit)."""

    depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        self.depth += 1
        try:
            if self.depth > MAX_YAML_DEPTH:
                raise _TooDeep(self.peek_event().start_mark.line + 1)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _expanded_nodes(node: yaml.Node, limit: int) -> int:
    """How many nodes ``node`` stands for once aliases are expanded (stops counting past ``limit``).

    Each distinct node is counted once (memoised by identity), so a bomb costs its text, not its size.
    """
    sizes: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(node, False)]
    while stack:
        current, children_done = stack.pop()
        if id(current) in sizes:
            continue
        children: list[yaml.Node] = []
        if isinstance(current, yaml.SequenceNode):
            children = list(current.value)
        elif isinstance(current, yaml.MappingNode):
            children = [n for pair in current.value for n in pair]
        if not children_done:
            stack.append((current, True))
            stack.extend((c, False) for c in children if id(c) not in sizes)
            continue
        sizes[id(current)] = min(limit + 1, 1 + sum(sizes.get(id(c), 1) for c in children))
    return sizes[id(node)]


def load_yaml_bounded(text: str, source: str, loader: type[yaml.SafeLoader] = yaml.SafeLoader) -> Any:
    """``text`` parsed by ``loader`` (a SafeLoader subclass) within the limits in the module
    docstring; a violation or a YAML error is a ConfigError naming ``source`` (and the line)."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_YAML_BYTES:
        raise YAMLLimitError(f"{source}: larger than {MAX_YAML_BYTES >> 10} KiB: not a posttrain config")
    bounded = type("BoundedLoader", (_BoundedComposer, loader), {})
    instance = bounded(text)
    try:
        node = instance.get_single_node()
        if node is None:
            return None
        if _expanded_nodes(node, MAX_YAML_NODES) > MAX_YAML_NODES:
            raise YAMLLimitError(
                f"{source}:{node.start_mark.line + 1}: expands to more than {MAX_YAML_NODES:,} values "
                "(YAML aliases repeated inside each other): not a posttrain config"
            )
        return instance.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        raise ConfigError(f"{source}{where}: invalid YAML: {getattr(exc, 'problem', None) or exc}") from None
    except (_TooDeep, RecursionError) as exc:
        where = f":{exc.line}" if isinstance(exc, _TooDeep) else ""
        raise YAMLLimitError(f"{source}{where}: nested deeper than {MAX_YAML_DEPTH} levels") from None
    finally:
        instance.dispose()


# Numbers a config may hold: every training, evaluation and generation count is far below these.
_MAX_ABS = 1e15


def check_config_values(raw: Any, source: str) -> None:
    """Every value of a config mapping (overrides applied) is plain: nested at most
    :data:`MAX_YAML_DEPTH` deep, and every number finite (NaN or infinity as a weight or a learning
    rate passes every ``> 0`` check and trains nothing, or worse). ConfigError naming the key.

    >>> check_config_values({"grpo": {"stages": [{"rewards": [{"weight": float("nan")}]}]}}, "c.yaml")
    Traceback (most recent call last):
    posttrain.core.errors.ConfigError: c.yaml: grpo.stages.0.rewards.0.weight: must be a finite number, got nan
    """
    try:
        check_depth(raw, MAX_YAML_DEPTH)
    except ValueError as exc:
        raise YAMLLimitError(f"{source}: {exc}") from None
    stack: list[tuple[str, Any]] = [("", raw)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, dict):
            stack.extend((f"{where}.{k}" if where else str(k), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{where}.{i}", v) for i, v in enumerate(value))
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{source}: {where}: must be a finite number, got {value}")
        elif isinstance(value, int | float) and not isinstance(value, bool) and abs(value) > _MAX_ABS:
            raise ConfigError(
                f"{source}: {where}: {value} is beyond any sensible setting (at most {_MAX_ABS:g})"
            )
