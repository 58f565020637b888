"""Paired accuracy of two engine variants on the same questions: does a faster bf16 kernel change results?

The exactness rule for speed work: fp32 outputs must equal ``generate``'s token for token (tests pin
that); bf16 outputs may change with a faster kernel when a paired comparison over at least 500
questions shows no significant accuracy difference against the previous engine. This script runs the
evaluator twice in one process on the same questions, greedy, once per variant, and prints each
accuracy with its Wilson interval, the paired difference B - A with Newcombe's interval, McNemar's
exact p, the flips each way and how many completions are identical.

Variants are switches of the engine (``--a`` / ``--b``): ``plain`` (no shared-prefix prefill),
``shared-prefix`` (the prefix a prefill's prompts share run once), ``compiled`` (torch.compile'd
decode pieces, where available).

    .venv/bin/python benchmarks/engine_paired.py --model PATH --data synthetic --limit 500
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import time

from posttrain.core.config import EvalConfig
from posttrain.core.stats import paired_difference, wilson_interval
from posttrain.data.eval_sets import eval_records_for
from posttrain.evaluation import evaluate
from posttrain.generation import engine
from posttrain.models.hardware import cpu_kind
from posttrain.models.loading import load_model_and_tokenizer


@contextlib.contextmanager
def variant(name: str):
    """The engine as the variant ``name`` runs it (module switches restored on exit)."""
    saved = engine.SHARED_PREFIX_MIN
    try:
        if name == "plain":
            engine.SHARED_PREFIX_MIN = 10**9  # never shared
        elif name != "shared-prefix":
            raise SystemExit(f"unknown variant {name!r}")
        yield
    finally:
        engine.SHARED_PREFIX_MIN = saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", default="synthetic", help="synthetic, a GSM8K .jsonl, hub[:split]")
    parser.add_argument("--limit", type=int, default=500)
    parser.add_argument("--max-new-tokens", type=int, default=256, help="max_completion_length")
    parser.add_argument("--system-prompt", default=None)
    parser.add_argument("--tools", default="", help="comma-separated engine tools (calculator)")
    parser.add_argument("--a", default="plain")
    parser.add_argument("--b", default="shared-prefix")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    name, records = eval_records_for(args.data, args.limit, "test")
    model, tokenizer = load_model_and_tokenizer(args.model, "bf16")
    cfg = EvalConfig(
        limit=args.limit,
        max_completion_length=args.max_new_tokens,
        tools=[t for t in args.tools.split(",") if t],
    )
    prompt = {"system_prompt": args.system_prompt} if args.system_prompt else {}
    print(f"model {args.model}; {name}, {len(records)} questions; bf16 greedy; CPU {cpu_kind()}")
    reports = {}
    for which in (args.a, args.b):
        start = time.perf_counter()
        with variant(which):
            reports[which] = evaluate(model, records, cfg, tokenizer=tokenizer, **prompt)
        t = reports[which].timings
        print(
            f"  {which:14s} {time.perf_counter() - start:6.1f} s, {t['tokens_per_second']:.1f} useful tok/s"
        )
    a, b = reports[args.a], reports[args.b]
    right_a = [r.correct_strict for r in a.records]
    right_b = [r.correct_strict for r in b.records]
    n = len(right_a)
    for which, right in ((args.a, right_a), (args.b, right_b)):
        low, high = wilson_interval(sum(right), n)
        print(f"  accuracy {which:14s} {sum(right) / n:.1%} [{low:.1%}, {high:.1%}] (Wilson 95 %)")
    fixed = sum(1 for x, y in zip(right_a, right_b, strict=True) if not x and y)
    broken = sum(1 for x, y in zip(right_a, right_b, strict=True) if x and not y)
    both = sum(1 for x, y in zip(right_a, right_b, strict=True) if x and y)
    diff = paired_difference(both, fixed, broken, n - both - fixed - broken)
    low, high = diff.interval.low, diff.interval.high
    same = sum(x.completion == y.completion for x, y in zip(a.records, b.records, strict=True))
    print(
        f"  B - A = {diff.interval.estimate:+.1%} [{low:+.1%}, {high:+.1%}] (Newcombe paired 95 %); "
        f"McNemar exact p = {diff.p_value:.3f}; flips: {fixed} fixed, {broken} broken; "
        f"identical completions {same}/{n}"
    )
    verdict = "no significant difference" if low <= 0 <= high else "SIGNIFICANT difference"
    print(f"  verdict: {verdict}")


if __name__ == "__main__":
    main()
