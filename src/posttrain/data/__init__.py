"""GSM8K-format data: the sources records come from (``sources``), the synthetic generator
(``synthetic``), train/eval preparation (``prepare``), the evaluation sets (``eval_sets``) and the
SFT/DPO datasets built from prepared data (``builders``).

The record schema, prompts and answer rules these build on live one layer down, in
:mod:`posttrain.core` (``gsm8k``, ``prompts``, ``parsing``). Nothing is re-exported here: importing
``datasets`` takes seconds, and only the modules that need it should pay for it.
"""
