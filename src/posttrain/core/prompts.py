"""The chat prompt and the answer format every stage trains toward.

SFT targets, DPO pairs, GRPO format rewards and the evaluator's strict parser all assume one output
format, so it is defined in exactly one place::

    <reasoning>
    ...worked steps...
    </reasoning>
    <answer>
    72
    </answer>

The config's default ``data.system_prompt`` is :data:`DEFAULT_SYSTEM_PROMPT`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from posttrain.core.calculator import render_calculator_form
from posttrain.core.errors import DataError
from posttrain.core.gsm8k import extract_final_answer
from posttrain.core.parsing import ANNOTATION_RE

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "FEW_SHOT_EXAMPLES",
    "build_prompt",
    "format_sft_target",
    "select_few_shot",
]

DEFAULT_SYSTEM_PROMPT = (
    "You are a careful math tutor. Solve the problem step by step.\n"
    "Respond in the following format:\n"
    "<reasoning>\n"
    "...\n"
    "</reasoning>\n"
    "<answer>\n"
    "...\n"
    "</answer>\n"
    "Put only the final number inside the answer tags, with no units or words."
)

# Worked examples written for this project (not drawn from GSM8K), so prepending them as few-shot
# turns can never leak held-out or test questions into the prompt.
FEW_SHOT_EXAMPLES: tuple[Mapping[str, str], ...] = (
    {
        "question": "A baker makes 4 trays of muffins with 12 muffins on each tray. She sells 30 muffins "
        "in the morning. How many muffins does she have left?",
        "solution": "The baker makes 4*12 = <<4*12=48>>48 muffins.\n"
        "After the morning she has 48-30 = <<48-30=18>>18 muffins left.\n#### 18",
    },
    {
        "question": "A jacket costs $80 and is on sale for 25% off. How much does the jacket cost on sale?",
        "solution": "The discount is 80*25/100 = $<<80*25/100=20>>20.\n"
        "The sale price is 80-20 = $<<80-20=60>>60.\n#### 60",
    },
    {
        "question": "Leo reads 15 pages of his book every day for 6 days. The book has 120 pages. "
        "How many pages does he still have to read?",
        "solution": "In 6 days Leo reads 15*6 = <<15*6=90>>90 pages.\n"
        "He still has 120-90 = <<120-90=30>>30 pages to read.\n#### 30",
    },
    {
        "question": "Three friends share 2 pizzas equally. Each pizza is cut into 9 slices. "
        "How many slices does each friend get?",
        "solution": "There are 2*9 = <<2*9=18>>18 slices.\nEach friend gets 18/3 = <<18/3=6>>6 slices.\n#### 6",
    },
)


def format_sft_target(solution: str, *, calculator: bool = False) -> str:
    """Rewrite a GSM8K worked solution into the trained ``<reasoning>``/``<answer>`` format.

    Without the calculator, annotations (``<<48/2=24>>``) are removed: the model computes every
    value itself. With ``calculator=True`` each annotated step is written the way the inline
    calculator completes it (:func:`posttrain.core.calculator.render_calculator_form`): the model
    learns to write the expression and ``=``, and the tool writes the value. The ``#### N`` line
    becomes the answer block holding the *normalized* number, the string the rewards compare against.

    >>> print(format_sft_target("She sold 48/2 = <<48/2=24>>24 clips.\\n#### 1,024"))
    <reasoning>
    She sold 48/2 = 24 clips.
    </reasoning>
    <answer>
    1024
    </answer>
    >>> format_sft_target("He paid $<<3*5=15>>15.\\n#### 15", calculator=True).splitlines()[1]
    'He paid $3*5 = 15.'
    """
    answer = extract_final_answer(solution)
    body = solution.rsplit("####", 1)[0]
    body = render_calculator_form(body) if calculator else ANNOTATION_RE.sub("", body)
    lines = [line.rstrip() for line in body.strip().splitlines()]
    reasoning = "\n".join(line for line in lines if line) or "The answer follows directly from the question."
    return f"<reasoning>\n{reasoning}\n</reasoning>\n<answer>\n{answer}\n</answer>"


def select_few_shot(n: int) -> tuple[Mapping[str, str], ...]:
    """The first ``n`` built-in worked examples (``data.few_shot``)."""
    if n < 0 or n > len(FEW_SHOT_EXAMPLES):
        raise DataError(f"data.few_shot must be between 0 and {len(FEW_SHOT_EXAMPLES)}, got {n}")
    return FEW_SHOT_EXAMPLES[:n]


def build_prompt(
    question: str,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    few_shot_examples: Sequence[Mapping[str, Any]] = (),
) -> list[dict[str, str]]:
    """Chat messages for one question: system, few-shot user/assistant pairs, then the question.

    An empty or ``None`` system prompt omits the system message (some chat templates, e.g.
    Gemma's, reject the system role). Few-shot examples are mappings with ``question`` and
    ``solution`` (a GSM8K worked solution, shown in the trained format).

    >>> [m["role"] for m in build_prompt("1+1?", "sys", select_few_shot(1))]
    ['system', 'user', 'assistant', 'user']
    >>> build_prompt("1+1?", "")
    [{'role': 'user', 'content': '1+1?'}]
    """
    messages: list[dict[str, str]] = []
    if system_prompt:
        messages.append({"role": "system", "content": system_prompt})
    for example in few_shot_examples:
        messages.append({"role": "user", "content": example["question"]})
        messages.append({"role": "assistant", "content": format_sft_target(example["solution"])})
    messages.append({"role": "user", "content": question})
    return messages
