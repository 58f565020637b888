"""GSM8K-format data: the sources records come from, the synthetic generator, train/eval preparation,
the evaluation sets, and the SFT/DPO datasets built from prepared data.

The record schema, prompts and answer rules these build on live one layer down, in
:mod:`posttrain.core` (``gsm8k``, ``prompts``, ``parsing``).
"""

from posttrain.data.builders import (
    DPO_FEATURES,
    DpoPair,
    build_dpo_dataset,
    build_sft_dataset,
    select_dpo_pair,
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
from posttrain.data.sources import LoadResult, load_hub, load_jsonl, load_records
from posttrain.data.synthetic import THEMES, generate_problems

__all__ = [
    "DPO_FEATURES",
    "FEATURES",
    "THEMES",
    "DpoPair",
    "LoadResult",
    "PreparedData",
    "build_dpo_dataset",
    "build_sft_dataset",
    "decontaminate",
    "filter_by_steps",
    "generate_problems",
    "load_hub",
    "load_jsonl",
    "load_records",
    "prepare_data",
    "prompt_token_lengths",
    "question_ngrams",
    "select_dpo_pair",
    "split_records",
]
