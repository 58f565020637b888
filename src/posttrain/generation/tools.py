"""Tools the generation engine runs inside a completion, in two protocols.

* ``inline`` (:class:`Calculator`): a text protocol that needs no tool-calling chat template, so it
  works with any model (SmolLM2 included). The tool reads what a row has written and forces the
  value's tokens after ``expression =``; what counts as a call and what the calculator writes is
  :mod:`posttrain.core.calculator`'s, this module only moves between text and token ids.
* ``chat`` (:class:`ChatToolLoop`): TRL's tool-calling protocol (``GRPOTrainer(tools=...,
  environment_factory=...)``) for models whose chat template renders tool calls (Qwen2.5 and
  newer). When a turn ends with tool calls, they are parsed with TRL's own parser, run, and the tool
  messages, rendered by the chat template exactly as TRL renders them, are forced before the next
  assistant turn. TRL generates the GRPO rollouts of such a stage itself; this class is what lets
  posttrain's evaluation run the same protocol, so a trained tool user is evaluated with its tools.

Either way the engine marks the tool's tokens 0 in the completion's ``env_mask`` and counts calls.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from posttrain.core.calculator import calculator, calculator_call
from posttrain.core.errors import ModelError
from posttrain.core.library_policy import import_named, is_custom
from posttrain.generation.engine import EngineTool, ToolCall

logger = logging.getLogger(__name__)

__all__ = [
    "BUILTIN_TOOL_FUNCTIONS",
    "ENGINE_TOOLS",
    "Calculator",
    "ChatToolLoop",
    "check_tool_template",
    "engine_tool",
    "make_tool",
    "tool_functions",
    "tool_suffix_ids",
]

ENGINE_TOOLS = ("calculator",)
"""Tools of the ``inline`` protocol (``tools:`` in a stage or evaluation section)."""

BUILTIN_TOOL_FUNCTIONS: dict[str, Callable[..., Any]] = {"calculator": calculator}
"""Tools of the ``chat`` protocol posttrain ships; other names are ``package.module:function``."""

WINDOW = 64
"""Completion tokens decoded to look for an inline call: far more than one step's expression needs."""


def _trigger_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of the tokens whose text ends in ``=`` (spaces allowed after it): the only tokens after
    which a completion can end in a call. Found from the vocabulary once, so the engine asks the
    calculator only after those tokens instead of decoding every row on every step."""
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    candidates = [i for i, piece in enumerate(pieces) if piece and ("=" in piece or "<0x3D>" in piece)]
    texts = tokenizer.batch_decode([[i] for i in candidates])
    return frozenset(i for i, text in zip(candidates, texts, strict=True) if text.rstrip(" \t").endswith("="))


class Calculator:
    """The inline calculator (:func:`posttrain.core.calculator.calculator_call`) as an engine tool.

    After a token ending in ``=``, the completion's last :data:`WINDOW` tokens are decoded; when
    they end in an arithmetic expression (or an open GSM8K annotation), the value's tokens are
    returned to be forced. A call the calculator cannot compute (``2**99 =``, ``1/0 =``) is a failed
    call: counted, nothing forced.
    """

    name = "calculator"

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.triggers = _trigger_ids(tokenizer)
        if not self.triggers:
            logger.warning("calculator: the tokenizer has no token ending in '='; it will never be called")

    def __call__(
        self, token_ids: Sequence[int], request: int = 0, prompt_ids: Sequence[int] = ()
    ) -> ToolCall | None:
        text = self.tokenizer.decode(list(token_ids[-WINDOW:]), skip_special_tokens=True)
        call = calculator_call(text)
        if call is None:
            return None
        if not call.ok:
            return ToolCall((), failures=1)
        return ToolCall(tuple(self.tokenizer.encode(call.insert, add_special_tokens=False)))


def tool_functions(names: Sequence[str]) -> list[Callable[..., Any]]:
    """The functions of a ``chat`` protocol ``tools:`` list: built-ins by name, ``package.module:function``
    imported (only with the custom-code opt-in)."""
    functions = []
    for name in names:
        if is_custom(name):
            function = import_named(name, "custom tool")
            if not callable(function):
                raise ValueError(f"custom tool {name!r} is not callable (it is a {type(function).__name__})")
            functions.append(function)
        elif name in BUILTIN_TOOL_FUNCTIONS:
            functions.append(BUILTIN_TOOL_FUNCTIONS[name])
        else:
            known = ", ".join(BUILTIN_TOOL_FUNCTIONS)
            raise ValueError(
                f"unknown tool {name!r}: built-in tools are {known}, or name 'package.module:function'"
            )
    return functions


def check_tool_template(tokenizer: Any) -> None:
    """The tokenizer's chat template renders tool calls (TRL's own ``supports_tool_calling`` check)
    and TRL knows how to parse its responses; else a one-line :class:`ModelError`."""
    from trl.chat_template_utils import add_response_schema, supports_tool_calling

    if not supports_tool_calling(tokenizer):
        raise ModelError(
            "its chat template cannot render tool calls (TRL's supports_tool_calling); tool_protocol: chat "
            "needs a template that does (Qwen2.5 and newer), or use tool_protocol: inline"
        )
    if (
        getattr(tokenizer, "response_template", None) is None
        and getattr(tokenizer, "response_schema", None) is None
    ):
        try:
            add_response_schema(tokenizer)
        except ValueError as exc:
            raise ModelError(f"TRL cannot parse this chat template's tool calls: {exc}") from None


def tool_suffix_ids(tokenizer: Any, tool_messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
    """Token ids of tool messages and the next assistant header, as TRL 1.16 renders them after a turn
    that ended in tool calls (``GRPOTrainer._get_tool_suffix_ids``): the chat template applied to a
    dummy exchange with and without the tool messages, the difference kept."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = tokenizer.apply_chat_template(
        dummy, add_generation_prompt=False, tokenize=True, return_dict=False, **template_kwargs
    )
    full = tokenizer.apply_chat_template(
        dummy + tool_messages, add_generation_prompt=True, tokenize=True, return_dict=False, **template_kwargs
    )
    ends = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    if ends:  # the turn's stop token is the boundary (templates add "\n" after it)
        prefix = prefix[: ends[-1] + 1]
    if list(full[: len(prefix)]) != list(prefix):
        raise ModelError(
            "the chat template renders a tool turn that does not extend the conversation before it"
        )
    return list(full[len(prefix) :])


class ChatToolLoop:
    """TRL's tool-calling protocol as an engine tool: a turn that stops with tool calls gets the tool
    messages and a new assistant header forced after it, and the row goes on generating.

    ``functions`` are the tools every row may call; with ``environment_factory`` each row also gets
    its own environment, reset with the row's record (``rows[request]``) as TRL resets one per
    example, whose public methods are tools too. A tool that raises is a failed call whose message
    reads ``{"error": ...}``, as in TRL. Calls per row stop at ``max_calls`` (TRL's
    ``max_tool_calling_iterations``; None: unbounded, the token budget still bounds them).
    """

    name = "chat-tools"

    def __init__(
        self,
        tokenizer: Any,
        stop_ids: Sequence[int],
        functions: Sequence[Callable[..., Any]] = (),
        environment_factory: Callable[[], Any] | None = None,
        rows: Sequence[Mapping[str, Any]] | None = None,
        max_calls: int | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        check_tool_template(tokenizer)
        if environment_factory is not None and rows is None:
            raise ValueError("an environment is reset with each row's record: pass rows=")
        self.tokenizer, self.functions = tokenizer, list(functions)
        self.factory, self.rows, self.max_calls = environment_factory, rows, max_calls
        self.template_kwargs = dict(template_kwargs or {})
        self.triggers = frozenset(stop_ids)
        self._turn_start: dict[int, int] = {}
        self._turns: dict[int, int] = {}
        self._environments: dict[int, Any] = {}

    def tools_for(self, request: int) -> list[Callable[..., Any]]:
        """The tools row ``request`` may call (its environment is made and reset on first use)."""
        if self.factory is None:
            return self.functions
        if request not in self._environments:
            environment = self.factory()
            environment.reset(**dict(self.rows[request]))  # type: ignore[index]
            self._environments[request] = environment
        environment = self._environments[request]
        methods = [
            getattr(environment, name)
            for name in dir(type(environment))
            if not name.startswith("_")
            and name not in ("reset", "get_reward")
            and callable(getattr(environment, name))
        ]
        return [*self.functions, *methods]

    def __call__(
        self, token_ids: Sequence[int], request: int, prompt_ids: Sequence[int] = ()
    ) -> ToolCall | None:
        from trl.chat_template_utils import parse_response

        if self.max_calls is not None and self._turns.get(request, 0) >= self.max_calls:
            return None
        tools = self.tools_for(request)
        start = self._turn_start.get(request, 0)
        prefix = [*prompt_ids, *token_ids[:start]]  # what came before the turn, as TRL passes it
        calls = parse_response(self.tokenizer, list(token_ids[start:]), prefix=prefix, tools=tools).get(
            "tool_calls"
        )
        if not calls:
            return None
        by_name = {getattr(f, "__name__", ""): f for f in tools}
        messages, failures = [], 0
        for call in calls:
            function = call.get("function", {}) if call.get("type") == "function" else {}
            name = function.get("name", call.get("name", "unknown"))
            try:
                if name not in by_name:
                    raise ValueError(f"Tool {name} not found.")
                result: Any = by_name[name](**function.get("arguments", {}))
            except Exception as exc:  # a tool's failure is the model's feedback, as in TRL  # noqa: BLE001
                failures += 1
                result = {"error": str(exc)}
            messages.append({"role": "tool", "name": name, "content": str(result)})
        suffix = tool_suffix_ids(self.tokenizer, messages, **self.template_kwargs)
        self._turn_start[request] = len(token_ids) + len(suffix)
        self._turns[request] = self._turns.get(request, 0) + 1
        return ToolCall(tuple(suffix), failures=failures, calls=len(calls))


def engine_tool(names: Sequence[str], tokenizer: Any) -> EngineTool | None:
    """The inline engine tool for a section's ``tools:`` list (None for an empty list)."""
    unknown = [n for n in names if n not in ENGINE_TOOLS]
    if unknown:
        raise ValueError(f"unknown engine tool(s) {unknown}; known: {list(ENGINE_TOOLS)}")
    return Calculator(tokenizer) if "calculator" in names else None


def make_tool(
    tools: Sequence[str],
    protocol: str,
    tokenizer: Any,
    *,
    stop_ids: Sequence[int] = (),
    environment_factory: str | None = None,
    rows: Sequence[Mapping[str, Any]] | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> EngineTool | None:
    """The engine tool of a section's ``tools`` / ``tool_protocol`` / ``environment_factory`` (None
    without tools). ``chat`` needs the generation's ``stop_ids`` (a turn ends there) and, with an
    environment, each request's record (``rows``)."""
    if not tools and environment_factory is None:
        return None
    if protocol == "inline":
        return engine_tool(tools, tokenizer)
    factory = import_named(environment_factory, "environment factory") if environment_factory else None
    return ChatToolLoop(
        tokenizer, stop_ids, tool_functions(tools), factory, rows, template_kwargs=template_kwargs
    )
