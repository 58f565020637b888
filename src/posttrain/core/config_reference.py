"""The config reference, generated from the schema: every key with its type, default and docstring.

The attribute docstrings of :mod:`posttrain.core.config` are the one source (pydantic reads them into
each field's ``description``), so the reference cannot drift from the code: ``posttrain config
[SECTION]`` prints it, and ``docs/config.md`` is its markdown (``posttrain config --markdown >
docs/config.md``; a test fails when the file is stale). Sections come in the order of a config file,
the way TRL's ``GRPOConfig`` docstring groups its parameters; a list of mappings is one section
(``grpo.stages[]``). A section type used in several places (``lora``, ``rewards``) is described in
each, so every section reads on its own.
"""

from __future__ import annotations

import inspect
import json
import re
import textwrap
import types
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import to_jsonable_python

from posttrain.core.config import PipelineConfig
from posttrain.core.library_policy import MANAGED_TRAINER_KEYS
from posttrain.core.trainer_options import TRAINER_DEFAULTS

__all__ = ["ConfigKey", "ConfigSection", "config_sections", "render_markdown", "render_text", "select"]

_TRL_CLASSES = {"sft": "trl.SFTConfig", "dpo": "trl.DPOConfig", "grpo": "trl.GRPOConfig"}


@dataclass(frozen=True)
class ConfigKey:
    path: str
    """Dotted key, ``[]`` after a list of mappings: ``grpo.stages[].rewards[].weight``."""
    type: str
    default: str
    """``required``, or the default as JSON (which YAML reads as it is); ``""`` where it is derived."""
    doc: str
    """What the key does: the field's docstring, with a pointer where it is a section of its own."""
    derived_from: str = ""
    """Where the default comes from, for a key whose value a file may leave to something else:
    the config file's stem (``name``), or the section a stage's ``lora`` and ``launch`` follow."""


@dataclass(frozen=True)
class ConfigSection:
    path: str
    """``""`` for the top level, else the dotted key of the mapping (``model.lora``, ``grpo.stages[]``)."""
    doc: str
    keys: tuple[ConfigKey, ...]


def config_sections(root: type[BaseModel] = PipelineConfig) -> list[ConfigSection]:
    """Every section of the schema in config-file order, each with its keys."""
    sections: list[ConfigSection] = []

    def visit(model: type[BaseModel], path: str, doc: str) -> None:
        keys, children = [], []
        for name, field in model.model_fields.items():
            key = f"{path}.{name}" if path else name
            sub, is_list = _section_type(field.annotation)
            key_doc = _doc(field)  # not `doc`: that is the section's own, appended below
            if sub is not None:
                sub_path = key + ("[]" if is_list else "")
                children.append((sub, sub_path, _section_doc(field, sub)))
                key_doc = f"{key_doc} Keys: see `{sub_path}`.".strip()
            keys.append(_key(model, name, field, key, key_doc))
        sections.append(ConfigSection(path, doc, tuple(keys)))
        for sub, sub_path, sub_doc in children:
            visit(sub, sub_path, sub_doc)

    visit(root, "", _clean(root.__dict__.get("__doc__") or ""))
    return sections


def select(sections: list[ConfigSection], name: str) -> list[ConfigSection]:
    """The sections at or under ``name`` (``grpo.stages``, ``grpo.stages.0.monitor`` and
    ``grpo.stages[].monitor`` all work), or the one key ``name`` names; [] when nothing matches."""
    wanted = _plain(name)
    found = [s for s in sections if _plain(s.path) == wanted or _plain(s.path).startswith(wanted + ".")]
    if found:
        return found
    for section in sections:
        keys = tuple(k for k in section.keys if _plain(k.path) == wanted)
        if keys:
            return [ConfigSection(section.path, "", keys)]
    return []


def render_markdown(sections: list[ConfigSection]) -> str:
    """The reference as one markdown page (docs/config.md)."""
    lines = [
        "# Config reference",
        "",
        "<!-- Generated from the docstrings of src/posttrain/core/config.py by",
        "     `posttrain config --markdown > docs/config.md`; edit the docstrings, not this file. -->",
        "",
        "One YAML file describes one whole run. Unknown keys are errors everywhere, and each stage's",
        "`trainer:` mapping is checked by building TRL's own config class. Override any key from the",
        "command line with `--set dotted.key=value` (list items by index: `--set",
        "grpo.stages.1.trainer.learning_rate=1e-5`; values are read as YAML). `posttrain config SECTION`",
        "prints one section of this page in the terminal.",
        "",
        "Defaults are written as JSON, which YAML reads as it is.",
        "",
        "Sections: " + ", ".join(f"[`{s.path or 'top level'}`](#{_anchor(s.path)})" for s in sections),
        "",
    ]
    for section in sections:
        lines += [f"## {_title(section.path)}", ""]
        if section.doc:
            lines += [_markdown(section.doc), ""]
        for key in section.keys:
            default = _default_words(key, "`{}`")
            lines.append(f"- **`{key.path}`** (`{key.type}`, {default}): {_markdown(key.doc)}")
        lines.append("")
    return "\n".join(lines)


def render_text(sections: list[ConfigSection], width: int = 100) -> str:
    """The reference for a terminal, wrapped to ``width`` columns."""
    out: list[str] = []
    for section in sections:
        out.append(f"[{section.path or 'top level'}]")
        for paragraph in section.doc.split("\n\n") if section.doc else []:
            out += textwrap.wrap(_plain_text(paragraph), width, initial_indent="  ", subsequent_indent="  ")
        for key in section.keys:
            default = _default_words(key, "{}")
            out.append(f"  {key.path}: {key.type}, {default}")
            if key.doc:
                out += textwrap.wrap(
                    _plain_text(key.doc), width, initial_indent="      ", subsequent_indent="      "
                )
        out.append("")
    return "\n".join(out).rstrip() + "\n"


# --------------------------------------------------------------------------- one key


def _key(model: type[BaseModel], name: str, field: FieldInfo, path: str, doc: str) -> ConfigKey:
    derived_from = getattr(model, "derived_defaults", {}).get(name, "")
    default = "" if derived_from else _default(field)
    kind = getattr(model, "trl_kind", None)
    if name == "trainer" and kind in TRAINER_DEFAULTS:
        # posttrain lays its own defaults under the YAML's options: they are the real defaults.
        doc = (
            f"Options of `{_TRL_CLASSES[kind]}`, passed through unchanged and checked by building it; "
            f"posttrain's defaults lie under them: `{_json(TRAINER_DEFAULTS[kind])}`. posttrain sets "
            f"{', '.join(f'`{k}`' for k in MANAGED_TRAINER_KEYS)} itself and refuses them here."
        )
    return ConfigKey(path, _type_name(field.annotation), default, doc, derived_from)


def _default_words(key: ConfigKey, quote: str) -> str:
    if key.derived_from:
        return f"default: {key.derived_from}"
    if key.default == "required":
        return key.default
    return f"default {quote.format(key.default)}"


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "{}"  # a section whose keys all take their defaults
    return _json(value)


def _json(value: Any) -> str:
    return json.dumps(to_jsonable_python(value), ensure_ascii=False)


def _type_name(annotation: Any) -> str:
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is None or annotation is type(None):
        return "null"
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list[{_type_name(args[0])}]" if args else "list"
    if origin is dict or annotation is dict:
        return "mapping"
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return "mapping"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def _section_type(annotation: Any) -> tuple[type[BaseModel] | None, bool]:
    """The model class a field holds (directly, optionally, or as a list of them) and whether it is a list."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation, False
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is list and args:
        inner, _ = _section_type(args[0])
        return inner, inner is not None
    if origin in (Union, types.UnionType):
        for arg in args:
            inner, is_list = _section_type(arg)
            if inner is not None:
                return inner, is_list
    return None, False


def _doc(field: FieldInfo) -> str:
    return _clean(field.description or "")


def _section_doc(field: FieldInfo, model: type[BaseModel]) -> str:
    """A section's introduction: what its key says, then what its type's own docstring adds."""
    parts = [_doc(field), _clean(model.__dict__.get("__doc__") or "")]
    return "\n\n".join(p for p in parts if p)


# --------------------------------------------------------------------------- text


def _clean(doc: str) -> str:
    """A docstring as paragraphs of single lines (Sphinx roles dropped, RST literals kept as ``x``)."""
    doc = re.sub(r":\w+:`~?([^`]+)`", r"``\1``", inspect.cleandoc(doc))
    paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", doc)]
    return "\n\n".join(p for p in paragraphs if p)


def _markdown(text: str) -> str:
    return text.replace("``", "`")


def _plain_text(text: str) -> str:
    return " ".join(text.replace("``", "`").split())


def _plain(path: str) -> str:
    """A dotted path without list markers or indices, so every spelling of a key compares equal.

    >>> _plain("grpo.stages.0.monitor"), _plain("grpo.stages[].monitor"), _plain("grpo.stages")
    ('grpo.stages.monitor', 'grpo.stages.monitor', 'grpo.stages')
    """
    return ".".join(p for p in path.replace("[]", "").split(".") if p and not p.isdigit())


def _title(path: str) -> str:
    return f"`{path}`" if path else "Top level"


def _anchor(path: str) -> str:
    """GitHub's heading anchor: lowercase, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^a-z0-9 _-]", "", _title(path).lower()).replace(" ", "-")
