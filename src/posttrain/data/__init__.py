"""GSM8K-format data: loading, synthetic problems, prompts, train/eval preparation, SFT/DPO datasets.

Names are re-exported lazily (PEP 562): ``posttrain.config`` imports
``posttrain.data.prompts`` for its default system prompt, which runs this file first, and eager
imports here would pull ``datasets`` (slow) into every config load and risk an import cycle.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "DataError": "gsm8k",
    "LoadResult": "gsm8k",
    "RECORD_FIELDS": "gsm8k",
    "count_steps": "gsm8k",
    "extract_final_answer": "gsm8k",
    "load_hub": "gsm8k",
    "load_jsonl": "gsm8k",
    "load_records": "gsm8k",
    "make_record": "gsm8k",
    "THEMES": "synthetic",
    "generate_problems": "synthetic",
    "DEFAULT_SYSTEM_PROMPT": "prompts",
    "FEW_SHOT_EXAMPLES": "prompts",
    "build_prompt": "prompts",
    "format_sft_target": "prompts",
    "select_few_shot": "prompts",
    "FEATURES": "prepare",
    "PreparedData": "prepare",
    "decontaminate": "prepare",
    "filter_by_steps": "prepare",
    "prepare_data": "prepare",
    "prompt_token_lengths": "prepare",
    "question_ngrams": "prepare",
    "split_records": "prepare",
    "DPO_FEATURES": "builders",
    "DpoPair": "builders",
    "build_dpo_dataset": "builders",
    "build_sft_dataset": "builders",
    "select_dpo_pair": "builders",
}

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "DPO_FEATURES",
    "DataError",
    "DpoPair",
    "FEATURES",
    "FEW_SHOT_EXAMPLES",
    "LoadResult",
    "PreparedData",
    "RECORD_FIELDS",
    "THEMES",
    "build_dpo_dataset",
    "build_prompt",
    "build_sft_dataset",
    "count_steps",
    "decontaminate",
    "extract_final_answer",
    "filter_by_steps",
    "format_sft_target",
    "generate_problems",
    "load_hub",
    "load_jsonl",
    "load_records",
    "make_record",
    "prepare_data",
    "prompt_token_lengths",
    "question_ngrams",
    "select_dpo_pair",
    "select_few_shot",
    "split_records",
]

if TYPE_CHECKING:
    from posttrain.data.builders import (
        DPO_FEATURES,
        DpoPair,
        build_dpo_dataset,
        build_sft_dataset,
        select_dpo_pair,
    )
    from posttrain.data.gsm8k import (
        RECORD_FIELDS,
        DataError,
        LoadResult,
        count_steps,
        extract_final_answer,
        load_hub,
        load_jsonl,
        load_records,
        make_record,
    )
    from posttrain.data.prepare import (
        FEATURES,
        PreparedData,
        decontaminate,
        filter_by_steps,
        prepare_data,
        prompt_token_lengths,
        question_ngrams,
        split_records,
    )
    from posttrain.data.prompts import (
        DEFAULT_SYSTEM_PROMPT,
        FEW_SHOT_EXAMPLES,
        build_prompt,
        format_sft_target,
        select_few_shot,
    )
    from posttrain.data.synthetic import THEMES, generate_problems


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
