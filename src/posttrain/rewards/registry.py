"""Name -> reward function lookup used by the training config and ``posttrain rewards check``.

Configs name rewards by short registry names (``correctness``, ``length``...) rather than import
paths so a typo fails fast with the list of valid names, before any model is loaded. Weights are NOT
handled here: TRL applies them through ``GRPOConfig.reward_weights``.

``build_reward(name, params)``:

* plain rewards (``correctness``, ``int_answer``, ``arithmetic``, ``setup``, ``strict_format``, ``soft_format``,
  ``xml_count``, ``reasoning_steps``) take no params;
* factories (``length``, ``repetition``) are called with ``params`` as keyword arguments;
* TRL's own rewards by their names in ``trl.rewards`` (``accuracy_reward``, ``think_format_reward``,
  ``get_soft_overlong_punishment``, ...), so a recipe from TRL or open-r1 ports without rewriting:
  the ``get_*`` factories take ``params``, the others none. Their metrics keep TRL's names
  (``rewards/accuracy_reward/mean``). TRL's accuracy rewards compare against a ``solution`` column;
  posttrain hands them its gold ``answer`` (the normalized final number) as ``solution``;
* ``"package.module:function"`` imports a custom reward; with params it is treated as a factory
  (called with them, must return a callable), without params it is the reward itself. A custom
  name is code chosen by whoever wrote the config, so it is imported only with an opt-in from
  outside the config: ``POSTTRAIN_ALLOW_CUSTOM_CODE=1`` in the environment (the CLI's
  ``--allow-custom-code`` sets it); without it the name is refused before anything is imported;
* any reward can be standardized by :func:`~posttrain.rewards.scaling.make_adaptive_scaler` with the
  reserved param ``adaptive``: ``true`` for default settings or a mapping of scaler settings
  (``momentum``, ``eps``, ``clip``, ``suffix``); ``false``/absent means no scaling.

>>> build_reward("length", {"min_tokens": 5, "max_tokens": 50}).__name__
'length_reward'
>>> build_reward("correctness", {"adaptive": {"momentum": 0.9}}).__name__
'correctness_reward_scaled'

:func:`check_reward` is what config validation uses: it checks the same rules without calling
anything it does not own (a custom function is imported only with the opt-in, and then only its
signature is read: a reward must accept ``completions`` and ``**kwargs``, a factory its params).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

from posttrain.core.library_policy import (
    CUSTOM_CODE_ENV,
    CustomCodeRefused,
    allow_custom_code,
    custom_code_allowed,
    import_named,
    is_custom,
)
from posttrain.rewards.accuracy import arithmetic_reward, correctness_reward, int_answer_reward, setup_reward
from posttrain.rewards.format import soft_format_reward, strict_format_reward, xml_count_reward
from posttrain.rewards.scaling import make_adaptive_scaler, reward_name
from posttrain.rewards.shaping import make_length_reward, make_repetition_penalty, reasoning_steps_reward

logger = logging.getLogger(__name__)

__all__ = [
    "ADAPTIVE_PARAM",
    "CUSTOM_CODE_ENV",
    "FACTORIES",
    "PLAIN_REWARDS",
    "CustomCodeRefused",
    "TrlReward",
    "allow_custom_code",
    "build_reward",
    "check_reward",
    "custom_code_allowed",
    "is_custom",
    "is_factory",
    "reward_names",
    "trl_reward_names",
]

PLAIN_REWARDS: dict[str, Callable[..., list[float | None]]] = {
    "correctness": correctness_reward,
    "int_answer": int_answer_reward,
    "arithmetic": arithmetic_reward,
    "setup": setup_reward,
    "strict_format": strict_format_reward,
    "soft_format": soft_format_reward,
    "xml_count": xml_count_reward,
    "reasoning_steps": reasoning_steps_reward,
}
FACTORIES: dict[str, Callable[..., Callable[..., list[float | None]]]] = {
    "length": make_length_reward,
    "repetition": make_repetition_penalty,
}
ADAPTIVE_PARAM = "adaptive"
# Keywords TRL passes every reward besides the dataset columns (FACTS.md, TRL 1.16), and the columns
# of posttrain's prepared data: a reward's required parameters must be among them.
_REWARD_KEYWORDS = {
    "prompts",
    "completions",
    "completion_ids",
    "trainer_state",
    "log_extra",
    "log_metric",
    "id",
    "question",
    "solution",
    "answer",
    "ops",
}


TRL_REWARDS_MODULE = "trl.rewards"


def trl_reward_names() -> list[str]:
    """The reward functions and factories ``trl.rewards`` exports (its submodules left out), sorted."""
    module = importlib.import_module(TRL_REWARDS_MODULE)
    return sorted(
        name
        for name in getattr(module, "__all__", dir(module))
        if not name.startswith("_") and inspect.isfunction(getattr(module, name, None))
    )


def reward_names() -> list[str]:
    """All names a stage may use, posttrain's and TRL's, sorted (custom ``module:function`` not listed)."""
    return sorted({*PLAIN_REWARDS, *FACTORIES, *trl_reward_names()})


def _is_trl_factory(fn: Callable[..., Any]) -> bool:
    """TRL's rewards all take ``**kwargs`` (the trainer passes every dataset column); its factories do not."""
    return not _accepted_params(fn)[1]


def is_factory(name: str) -> bool:
    """Whether ``name`` (posttrain's or TRL's) takes params."""
    if name in FACTORIES:
        return True
    return name in trl_reward_names() and _is_trl_factory(_trl_function(name))


def _trl_function(name: str) -> Callable[..., Any]:
    return getattr(importlib.import_module(TRL_REWARDS_MODULE), name)


class TrlReward:
    """One of TRL's rewards, called with posttrain's gold ``answer`` as TRL's ``solution``.

    A callable class rather than a closure so TRL's async rollout worker can pickle it; ``__name__``
    is the TRL reward's own, so its metrics keep TRL's names.
    """

    def __init__(self, reward_fn: Callable[..., Any]) -> None:
        self.reward_fn = reward_fn
        self.__name__ = reward_name(reward_fn)
        accepted, _ = _accepted_params(reward_fn)
        self._wants_solution = "solution" in accepted

    def __call__(self, completions: list[Any], **kwargs: Any) -> list[float | None]:
        if self._wants_solution and "answer" in kwargs:
            kwargs["solution"] = kwargs["answer"]
        return self.reward_fn(completions=completions, **kwargs)


def _build_trl(name: str, params: dict[str, Any]) -> Callable[..., Any]:
    fn = _trl_function(name)
    if _is_trl_factory(fn):
        fn = _call_with_params(f"TRL reward factory {name!r}", fn, params)
    elif params:
        got = ", ".join(map(repr, params))
        raise ValueError(f"TRL reward {name!r} takes no params (only {ADAPTIVE_PARAM!r}), got {got}")
    return TrlReward(fn)


def _accepted_params(fn: Callable[..., Any], skip: tuple[str, ...] = ()) -> tuple[list[str], bool]:
    """Keyword names ``fn`` accepts and whether it also takes ``**kwargs``."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # builtins without a signature: let the call itself decide
        return [], True
    names = [
        p.name
        for p in parameters
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in skip
    ]
    return names, any(p.kind is p.VAR_KEYWORD for p in parameters)


def _call_with_params(label: str, fn: Callable[..., Any], params: dict[str, Any]) -> Any:
    """Call ``fn(**params)``, turning unknown or invalid params into a ValueError naming ``label``."""
    accepted, var_kwargs = _accepted_params(fn)
    unknown = sorted(set(params) - set(accepted))
    if unknown and not var_kwargs:
        raise ValueError(
            f"{label} got unknown param(s) {', '.join(map(repr, unknown))}; "
            f"accepted params: {', '.join(accepted) or '(none)'}"
        )
    try:
        return fn(**params)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{label}: invalid params {params!r}: {exc}") from exc


def _scaler_settings(name: str, adaptive: Any) -> dict[str, Any] | None:
    if adaptive is None or adaptive is False:
        return None
    if adaptive is True:
        return {}
    if isinstance(adaptive, Mapping):
        return dict(adaptive)
    raise ValueError(
        f"reward {name!r}: param {ADAPTIVE_PARAM!r} must be true/false or a mapping of scaler settings "
        f"(momentum, eps, clip, suffix), got {adaptive!r}"
    )


def _import_custom(name: str) -> Any:
    return import_named(name, "custom reward")


def _build_custom(name: str, params: dict[str, Any]) -> Callable[..., Any]:
    obj = _import_custom(name)
    if not callable(obj):
        raise ValueError(f"custom reward {name!r} is not callable (it is a {type(obj).__name__})")
    if not params:
        return obj
    reward = _call_with_params(f"custom reward factory {name!r}", obj, params)
    if not callable(reward):
        raise ValueError(
            f"custom reward {name!r} was called as a factory (params given) but returned "
            f"{type(reward).__name__}, not a reward function"
        )
    return reward


def _reward_signature_problem(fn: Callable[..., Any]) -> str | None:
    """Why ``fn`` cannot be called as TRL calls a reward, or None if it can (nothing is called)."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return "its signature cannot be read"
    if not any(p.kind is p.VAR_KEYWORD for p in parameters):
        return "it does not take **kwargs (TRL passes every dataset column as a keyword)"
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if "completions" not in names:
        return "it has no `completions` parameter"
    required = [
        p.name
        for p in parameters
        if p.default is p.empty
        and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        and (p.kind is p.POSITIONAL_ONLY or p.name not in _REWARD_KEYWORDS)
    ]
    if required:
        return f"it requires {', '.join(map(repr, required))}, which TRL never passes"
    return None


def _check_custom(name: str, params: dict[str, Any]) -> None:
    """A custom reward's signature, read without calling it (imported only with the opt-in)."""
    obj = _import_custom(name)
    if not callable(obj):
        raise ValueError(f"custom reward {name!r} is not callable (it is a {type(obj).__name__})")
    if params:
        accepted, var_kwargs = _accepted_params(obj)
        unknown = sorted(set(params) - set(accepted))
        if unknown and not var_kwargs:
            raise ValueError(
                f"custom reward factory {name!r} got unknown param(s) {', '.join(map(repr, unknown))}; "
                f"accepted params: {', '.join(accepted) or '(none)'}"
            )
        try:
            inspect.signature(obj).bind(**params)
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"custom reward factory {name!r}: params {sorted(params)} do not fit: {exc}"
            ) from None
        return
    problem = _reward_signature_problem(obj)
    if problem:
        raise ValueError(
            f"custom reward {name!r} is not a reward function f(completions, **kwargs): {problem} "
            "(give `params` to use it as a factory)"
        )


def check_reward(name: str, params: Mapping[str, Any] | None = None) -> None:
    """Raise ``ValueError`` if :func:`build_reward` would refuse ``name`` with ``params``.

    Used by config validation, so it never calls code it does not own: built-in factories and the
    adaptive scaler (posttrain's own pure functions) are called to check their params' values; a
    custom ``module:function`` is refused without the opt-in (see :func:`custom_code_allowed`)
    before anything is imported, and with it only its signature is read.

    >>> check_reward("os:system", {"command": "touch /tmp/x"})
    Traceback (most recent call last):
    ...
    posttrain.core.library_policy.CustomCodeRefused: custom reward 'os:system' would import and run code named by the config; allow it with --allow-custom-code (or POSTTRAIN_ALLOW_CUSTOM_CODE=1) if you trust this config
    """
    name, params, scaler = _split_params(name, params)
    if is_custom(name):
        _check_custom(name, params)
        reward: Callable[..., Any] = _unscored
    else:
        reward = _builtin(name, params)
    if scaler is not None:
        _build_scaler(name, reward, scaler)


def _unscored(completions: Any, **kwargs: Any) -> list[float]:
    """Stand-in for a custom reward while its scaler settings are checked (never scored)."""
    return [0.0 for _ in completions]


def _split_params(
    name: Any, params: Mapping[str, Any] | None
) -> tuple[str, dict[str, Any], dict[str, Any] | None]:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"reward name must be a non-empty string, got {name!r}")
    name = name.strip()
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ValueError(f"reward {name!r}: params must be a mapping, got {type(params).__name__}")
    params = dict(params)
    scaler = _scaler_settings(name, params.pop(ADAPTIVE_PARAM, None))
    return name, params, scaler


def _builtin(name: str, params: dict[str, Any]) -> Callable[..., list[float | None]]:
    if name in PLAIN_REWARDS:
        if params:
            got = ", ".join(map(repr, params))
            raise ValueError(f"reward {name!r} takes no params (only {ADAPTIVE_PARAM!r}), got {got}")
        return PLAIN_REWARDS[name]
    if name in FACTORIES:
        return _call_with_params(f"reward {name!r}", FACTORIES[name], params)
    if name in trl_reward_names():
        return _build_trl(name, params)
    close = difflib.get_close_matches(name, reward_names(), n=3)
    hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
    raise ValueError(
        f"unknown reward {name!r}{hint}; valid rewards: {', '.join(reward_names())} "
        "(or a custom 'package.module:function')"
    )


def build_reward(name: str, params: Mapping[str, Any] | None = None) -> Callable[..., list[float | None]]:
    """Reward function for a registry name or ``package.module:function``, configured by ``params``.

    See the module docstring for the rules; every problem (unknown name, params on a plain reward,
    unknown or invalid factory params, failed import, non-callable) raises ``ValueError`` whose
    message names the reward and, where relevant, the offending and the accepted params.

    >>> build_reward("nope")
    Traceback (most recent call last):
    ...
    ValueError: unknown reward 'nope'; valid rewards: accuracy_reward, arithmetic, correctness, \
get_cosine_scaled_reward, get_repetition_penalty_reward, get_soft_overlong_punishment, int_answer, \
length, reasoning_accuracy_reward, reasoning_steps, repetition, setup, soft_format, strict_format, \
think_format_reward, xml_count (or a custom 'package.module:function')
    """
    name, params, scaler = _split_params(name, params)
    reward = _build_custom(name, params) if is_custom(name) else _builtin(name, params)
    if scaler is not None:
        reward = _build_scaler(name, reward, scaler)
    logger.debug("built reward %r as %s", name, reward_name(reward))
    return reward


def _build_scaler(name: str, reward: Callable[..., Any], settings: dict[str, Any]) -> Callable[..., Any]:
    accepted, _ = _accepted_params(make_adaptive_scaler, skip=("reward_fn",))
    unknown = sorted(set(settings) - set(accepted))
    if unknown:
        raise ValueError(
            f"reward {name!r}: unknown {ADAPTIVE_PARAM} setting(s) {', '.join(map(repr, unknown))}; "
            f"accepted: {', '.join(accepted)}"
        )
    try:
        return make_adaptive_scaler(reward, **settings)
    except ValueError as exc:
        raise ValueError(f"reward {name!r}: invalid {ADAPTIVE_PARAM} settings {settings!r}: {exc}") from exc
