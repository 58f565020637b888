"""GSM8K reward functions for TRL's GRPOTrainer, the shared answer parser, and the reward registry.

Pure Python on purpose (no torch/trl imports): the evaluator, the config validator and
``posttrain rewards check`` all import it cheaply, and it is testable without a GPU stack.
"""

from posttrain.core.parsing import (
    ParsedAnswer,
    answers_match,
    completion_text,
    is_soft_format,
    is_strict_format,
    normalize_number,
    parse_answers,
    parse_flexible,
    parse_strict,
)
from posttrain.rewards.accuracy import correctness_reward, int_answer_reward
from posttrain.rewards.format import soft_format_reward, strict_format_reward, xml_count_reward
from posttrain.rewards.registry import build_reward, reward_names
from posttrain.rewards.scaling import make_adaptive_scaler, reward_name
from posttrain.rewards.shaping import make_length_reward, make_repetition_penalty, reasoning_steps_reward

__all__ = [
    "ParsedAnswer",
    "answers_match",
    "build_reward",
    "completion_text",
    "correctness_reward",
    "int_answer_reward",
    "is_soft_format",
    "is_strict_format",
    "make_adaptive_scaler",
    "make_length_reward",
    "make_repetition_penalty",
    "normalize_number",
    "parse_answers",
    "parse_flexible",
    "parse_strict",
    "reasoning_steps_reward",
    "reward_name",
    "reward_names",
    "soft_format_reward",
    "strict_format_reward",
    "xml_count_reward",
]
