"""Throughput of posttrain's evaluator against the two usual ways of running GSM8K generation.

(a) one ``model.generate`` call per question, fp32 (the naive loop);
(b) ``model.generate`` on padded batches of 32, fp32 (the usual "batched" eval);
(c) posttrain's evaluator: continuous batching, precision ``auto`` (bf16 where the CPU has AMX);
    ``--c auto,auto:64,fp32`` runs it once per precision[:batch] item.
(d) transformers' own continuous batching, ``model.generate_batch`` (paged KV cache, sdpa), in the
    precision of the first (c) item; ``--d default,256,1024`` runs it once per ``max_batch_tokens``
    setting (``default`` = transformers' own sizing). The anchor a user would otherwise pick.

All three decode greedily with the same prompts and ``max_new_tokens``. Throughput counts *useful*
tokens: generated tokens up to and including the first EOS, never padding or post-EOS tokens.
(a) is slow (~28 tok/s for SmolLM2 on 2 idle cores), so by default it runs on the first
``--limit-a`` questions only and its tokens/s is taken as representative; the output says so.

Answer agreement compares parsed (strict, flexible) answers with (a)'s, over the questions where at
least one of the two completions has a number: two answerless completions agree on nothing. In fp32 the evaluator reproduces (a) token for
token; bf16 changes the numerics, and an untrained model's greedy text then diverges (often within
the first tokens), so bf16-vs-fp32 agreement measures the precision, not the engine. The
``(b) vs (a)`` line shows how much padding alone changes in fp32, for scale.

    .venv/bin/python benchmarks/eval_throughput.py --data data/gsm8k/train.jsonl --limit 128
    .venv/bin/python benchmarks/eval_throughput.py --model tiny-random --limit 16 --limit-a 4  # self-check
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch

from posttrain.core.config import EvalConfig
from posttrain.core.prompts import DEFAULT_SYSTEM_PROMPT, build_prompt
from posttrain.data.sources import load_jsonl
from posttrain.evaluation import evaluate
from posttrain.evaluation.scoring import SampleScore, answers_agree, score_completion
from posttrain.generation.engine import encode_prompts, stop_token_ids
from posttrain.models.hardware import cpu_kind, decode_flops_per_token, matmul_gflops
from posttrain.models.loading import load_model_and_tokenizer

TARGETS = {"c/a": 25.0, "c/b": 4.0, "c/d": 1.5, "agreement": 0.95, "matmul share": 0.25}


class LoadWatch:
    """Highest 1-minute load average seen at phase boundaries: other jobs on a shared CPU skew timings."""

    def __init__(self) -> None:
        self.peak = os.getloadavg()[0]

    def mark(self) -> float:
        self.peak = max(self.peak, os.getloadavg()[0])
        return self.peak


def useful_tokens(generated: list[int], stop: set[int]) -> list[int]:
    """Generated ids up to and including the first stop token (what a user actually gets)."""
    for index, token in enumerate(generated):
        if token in stop:
            return generated[: index + 1]
    return generated


def run_generate(
    model, tokenizer, prompts: list[list[int]], batch_size: int, max_new_tokens: int, stop: set[int]
) -> tuple[list[list[int]], float]:
    """Greedy ``generate`` in fixed-size left-padded batches, in dataset order; (useful ids, seconds)."""
    outputs: list[list[int]] = []
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(prompts), batch_size):
            chunk = prompts[first : first + batch_size]
            enc = tokenizer.pad({"input_ids": chunk}, padding=True, return_tensors="pt")
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=sorted(stop),
                pad_token_id=tokenizer.pad_token_id,
            )
            width = enc["input_ids"].shape[1]
            outputs += [useful_tokens(row[width:].tolist(), stop) for row in out]
            print(f"    {len(outputs)}/{len(prompts)} done, {time.perf_counter() - start:.0f} s", flush=True)
    return outputs, time.perf_counter() - start


def run_generate_batch(
    model, prompts: list[list[int]], max_new_tokens: int, stop: set[int], max_batch_tokens: int | None
) -> tuple[list[list[int]], float]:
    """Greedy ``model.generate_batch`` (transformers' continuous batching); (useful ids in order, seconds)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=sorted(stop), pad_token_id=min(stop)
    )
    batching = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens)
    start = time.perf_counter()
    with torch.inference_mode():
        results = model.generate_batch(
            prompts,
            generation_config=config,
            continuous_batching_config=batching,
            progress_bar=True,
            warmup=False,
        )  # warmup pre-captures CUDA graphs: nothing to capture on a CPU
    seconds = time.perf_counter() - start
    ordered = sorted(results.values(), key=lambda r: int(r.request_id.rsplit("_", 1)[1]))
    assert [r.prompt_ids for r in ordered] == prompts, "generate_batch returned requests out of order"
    return [useful_tokens(list(r.generated_tokens), stop) for r in ordered], seconds


def parsed(tokenizer, ids: list[int], gold: str) -> SampleScore:
    return score_completion(tokenizer.decode(ids, skip_special_tokens=True), gold)


def agreement(pairs) -> tuple[list[int], list[int]]:
    """(indices where both answers agree, indices where at least one side has an answer)."""
    verdicts = [answers_agree(a, b) for a, b in pairs]
    comparable = [i for i, verdict in enumerate(verdicts) if verdict is not None]
    return [i for i in comparable if verdicts[i]], comparable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="data/gsm8k/train.jsonl", help="GSM8K-format .jsonl")
    parser.add_argument("--limit", type=int, default=128, help="questions for (b) and (c)")
    parser.add_argument("--limit-a", type=int, default=16, help="questions timed for (a); 0 = all of --limit")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=32, help="batch of (b)")
    parser.add_argument(
        "--c",
        default="auto",
        help="evaluator runs as precision[:batch] items, comma-separated, e.g. auto,auto:32,fp32 "
        "(batch defaults to the evaluator's default, eval.batch_size)",
    )
    parser.add_argument(
        "--d",
        default="default",
        help="generate_batch runs as max_batch_tokens items, comma-separated (default = transformers' "
        "sizing); empty to skip (d)",
    )
    parser.add_argument("--refill-at", type=float, default=None, help="engine refill fraction for (c)")
    parser.add_argument("--skip-b", action="store_true", help="skip (b) (minutes on SmolLM2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)

    variants = []
    for item in args.c.split(","):
        precision, _, batch = item.partition(":")
        variants.append((precision, int(batch) if batch else EvalConfig().batch_size))
    watch = LoadWatch()
    records = load_jsonl(args.data, limit=args.limit).records
    limit_a = min(args.limit_a or len(records), len(records))
    model32, tokenizer = load_model_and_tokenizer(args.model, precision="fp32")
    stop = stop_token_ids(model32, tokenizer)
    prompts = encode_prompts(tokenizer, [build_prompt(r["question"], DEFAULT_SYSTEM_PROMPT) for r in records])
    mean_prompt = sum(map(len, prompts)) / len(prompts)
    print(
        f"model {args.model}; {len(records)} questions; mean prompt {mean_prompt:.0f} tokens; "
        f"max_new_tokens {args.max_new_tokens}; greedy; torch threads {torch.get_num_threads()}; "
        f"CPU {cpu_kind()}"
    )
    bf16_rate = matmul_gflops(torch.bfloat16)
    print(f"bf16 matmul rate (best torch.matmul of training-sized shapes): {bf16_rate:.0f} GFLOP/s")
    flops_config = model32.config

    print(f"(a) one generate call per question, fp32, on the first {limit_a} questions")
    out_a, sec_a = run_generate(model32, tokenizer, prompts[:limit_a], 1, args.max_new_tokens, stop)
    tps_a = sum(map(len, out_a)) / sec_a
    print(f"    load average so far <= {watch.mark():.1f}")
    out_b, tps_b = None, None
    if not args.skip_b:
        print(f"(b) batched generate, fp32, batch {args.batch_size}, left padding, {len(records)} questions")
        out_b, sec_b = run_generate(model32, tokenizer, prompts, args.batch_size, args.max_new_tokens, stop)
        tps_b = sum(map(len, out_b)) / sec_b
        print(f"    load average so far <= {watch.mark():.1f}")
    del model32

    reports = []
    for precision, batch_size in variants:
        print(f"(c) posttrain evaluator, precision {precision}, batch {batch_size}, {len(records)} questions")
        cfg = EvalConfig(
            data="local",
            path=args.data,
            limit=args.limit,
            max_completion_length=args.max_new_tokens,
            batch_size=batch_size,
        )
        extra = {"refill_at": args.refill_at} if args.refill_at is not None else {}
        reports.append(evaluate(args.model, records, cfg, precision=precision, progress=True, **extra))
    print(f"    load average so far <= {watch.mark():.1f}")

    d_runs = []  # (setting, useful ids, seconds)
    if args.d:
        precision = variants[0][0]
        model_d, _ = load_model_and_tokenizer(args.model, precision=precision)
        model_d.set_attn_implementation("sdpa")
        for setting in args.d.split(","):
            max_batch_tokens = None if setting == "default" else int(setting)
            print(f"(d) transformers generate_batch, precision {precision}, max_batch_tokens {setting}")
            out_d, sec_d = run_generate_batch(model_d, prompts, args.max_new_tokens, stop, max_batch_tokens)
            d_runs.append((setting, out_d, sec_d))
        del model_d
        print(f"    load average so far <= {watch.mark():.1f}")

    print("\nuseful tokens/s (generated up to and including EOS; padding and post-EOS tokens excluded)")
    print(
        f"  (a) per-question generate, fp32 : {tps_a:8.1f}  ({sum(map(len, out_a))} tokens in {sec_a:.1f} s "
        f"on {limit_a} questions; full run extrapolated: ~{sec_a * len(records) / limit_a:.0f} s)"
    )
    if tps_b is not None:
        print(
            f"  (b) batched generate, fp32      : {tps_b:8.1f}  "
            f"({sum(map(len, out_b))} tokens in {sec_b:.1f} s)"
        )
        b_vs_a, with_answer = agreement(
            (
                parsed(tokenizer, out_b[i], records[i]["answer"]),
                parsed(tokenizer, out_a[i], records[i]["answer"]),
            )
            for i in range(limit_a)
        )
        same_tokens = sum(out_b[i] == out_a[i] for i in range(limit_a))
        print(
            f"      (b) vs (a), both fp32: parsed answers equal on {len(b_vs_a)}/{len(with_answer)} "
            f"questions with an answer, identical tokens on {same_tokens}/{limit_a}"
        )
    tps_d = None
    for setting, out_d, sec_d in d_runs:
        tps = sum(map(len, out_d)) / sec_d
        tps_d = max(tps_d or 0.0, tps)  # (c) is compared with (d)'s best setting
        same, comparable = agreement(
            (
                parsed(tokenizer, out_d[i], records[i]["answer"]),
                parsed(tokenizer, out_a[i], records[i]["answer"]),
            )
            for i in range(limit_a)
        )
        print(
            f"  (d) generate_batch {variants[0][0]}, max_batch_tokens {setting}: {tps:8.1f}  "
            f"({sum(map(len, out_d))} tokens in {sec_d:.1f} s); parsed answers equal to (a)'s on "
            f"{len(same)}/{len(comparable)} questions with an answer, identical tokens on "
            f"{sum(out_d[i] == out_a[i] for i in range(limit_a))}/{limit_a}"
        )
    for (precision, batch_size), report in zip(variants, reports, strict=True):
        print(f"\n(c) precision {precision} ({report.meta.get('dtype')}), batch {batch_size}")
        describe_c(report, tokenizer, records, out_a, tps_a, out_b, tps_b, limit_a, tps_d)
        describe_flops(report, flops_config, mean_prompt, bf16_rate)
    cores = os.cpu_count() or 1
    if watch.mark() > cores + 0.5:
        print(
            f"\nWARNING: load average reached {watch.peak:.1f} on {cores} cores: other processes shared "
            "the CPU during this run, so the timings and ratios above are not reliable; "
            "rerun on an idle machine."
        )


def describe_flops(report, config, mean_prompt: float, bf16_rate: float) -> None:
    """The matmul work (c) did per second, as a share of the machine's bf16 matmul rate: how far the
    engine is from compute-bound. A token's FLOPs are counted at the mean context a decode step sees
    (prompt plus half the mean completion); prefill work is left out, so the share is a lower bound."""
    tokens = report.timings["generated_tokens"]
    context = mean_prompt + tokens / max(report.timings["sequences"], 1) / 2
    gflops = decode_flops_per_token(config, context) * tokens / report.timings["seconds"] / 1e9
    share = gflops / bf16_rate
    verdict = "met" if share >= TARGETS["matmul share"] else "NOT met"
    print(
        f"  decode work {gflops:.1f} GFLOP/s = {share:.1%} of the bf16 matmul rate "
        f"(target >= {TARGETS['matmul share']:.0%}: {verdict})"
    )


def describe_c(report, tokenizer, records, out_a, tps_a, out_b, tps_b, limit_a, tps_d=None) -> None:
    """Throughput, ratios, answer agreement and target verdicts of one evaluator run."""
    tps_c = report.timings["tokens_per_second"]
    print(
        f"  useful tokens/s {tps_c:.1f} ({report.timings['generated_tokens']} tokens in "
        f"{report.timings['seconds']:.1f} s, mean batch rows {report.timings['mean_batch_rows']}, "
        f"{report.timings['prefills']} prefills)"
    )
    ratios = {"c/a": tps_c / tps_a}
    if tps_b:
        ratios["c/b"] = tps_c / tps_b
    if tps_d:
        ratios["c/d"] = tps_c / tps_d
    answers_a = [parsed(tokenizer, out_a[i], records[i]["answer"]) for i in range(limit_a)]
    agree, comparable = agreement(zip(answers_a, report.records[:limit_a], strict=True))
    if comparable:  # no question with an answer on either side: nothing to agree on
        ratios["agreement"] = len(agree) / len(comparable)
    extrap = " ((a) timed on a subset)" if limit_a < len(records) else ""
    print(
        f"  c/a = {ratios['c/a']:.1f}x{extrap}"
        + (f"   c/b = {ratios['c/b']:.1f}x" if "c/b" in ratios else "")
        + (f"   c/d = {ratios['c/d']:.1f}x (best (d) setting)" if "c/d" in ratios else "")
    )
    differing = [records[i]["id"] for i in comparable if i not in set(agree)]
    print(
        f"  parsed answers (strict, flexible) equal to (a)'s on {len(agree)}/{len(comparable)} questions "
        f"with an answer on either side ({limit_a - len(comparable)} of {limit_a} without any left out)"
        + (f"; differ: {', '.join(differing)}" if differing else "")
    )
    if out_b is not None:
        same_b, comparable_b = agreement(
            (parsed(tokenizer, out_b[i], records[i]["answer"]), report.records[i])
            for i in range(len(records))
        )
        print(
            f"  parsed answers equal to (b)'s on {len(same_b)}/{len(comparable_b)} questions with an answer"
        )
    print(
        f"  accuracy strict {report.summary['accuracy_strict']:.1%}, flexible "
        f"{report.summary['accuracy_flexible']:.1%}, truncated {report.summary['truncation_rate']:.1%}"
    )
    for key, target in TARGETS.items():
        if key in ratios:
            verdict = "met" if ratios[key] >= target else "NOT met"
            shown = f"{ratios[key]:.1%}" if key == "agreement" else f"{ratios[key]:.1f}x"
            print(f"  target {key} >= {target:g}: {shown} -> {verdict}")


if __name__ == "__main__":
    main()
