"""GSM8K evaluation: prompts in, completions generated, scored with the rewards' parser, report out.

`evaluate` is what the pipeline calls after each stage (with an in-memory model or a stage's
output directory) and `run_eval` is what ``posttrain eval`` calls. Both produce an
:class:`~posttrain.evaluation.report.EvalReport` whose numbers are comparable across runs: the same
first-N questions, greedy decoding by default, and per-sample seeds derived from (seed, example
id, sample index) so sampled runs do not depend on batch size or order either.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import platform
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from posttrain.core.config import EvalConfig
from posttrain.core.prompts import DEFAULT_SYSTEM_PROMPT, build_prompt
from posttrain.data.eval_sets import eval_records_for, eval_set_info, parse_data_arg
from posttrain.evaluation.lm_eval_gsm8k import lm_eval_accuracy
from posttrain.evaluation.report import EvalRecord, EvalReport
from posttrain.evaluation.scoring import canonical_gold, score_completion, summarize
from posttrain.generation.engine import (
    Completion,
    GenerationStats,
    encode_prompts,
    generate_continuous,
    pad_token_id,
    stop_token_ids,
)
from posttrain.generation.tools import ChatToolLoop, make_tool
from posttrain.generation.vllm_server import ServerAddress
from posttrain.generation.vllm_server_client import generate_via_server
from posttrain.models.hardware import resolve_dtype
from posttrain.models.loading import load_model_and_tokenizer, load_tokenizer
from posttrain.models.resolve import resolve_model_path

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_REFILL_AT", "evaluate", "run_eval"]

DEFAULT_REFILL_AT = 0.5
"""Admit waiting prompts once the batch is down to half its rows: a prefill costs about as much for
few rows as for many, so waiting for half the rows to finish pays it less often while the batch
stays full enough (docs/results/2026-12-01-decode-experiments.md has the ``--refill-at`` runs)."""


def _records(dataset: Any, limit: int | None) -> list[dict[str, Any]]:
    """The first ``limit`` examples as dicts, checked for the fields evaluation needs."""
    if limit and hasattr(dataset, "select"):  # a datasets.Dataset: avoid materialising rows past the limit
        dataset = dataset.select(range(min(limit, len(dataset))))
    records = [dict(row) for row in (dataset[:limit] if limit and isinstance(dataset, list) else dataset)]
    for index, record in enumerate(records):
        missing = [key for key in ("id", "question", "answer") if key not in record]
        if missing:
            raise ValueError(
                f"eval example {index} lacks field(s) {', '.join(missing)} (needs id, question, answer)"
            )
        record["id"] = str(record["id"])
    if not records:
        raise ValueError("the evaluation dataset is empty")
    return records


_SERVED = ("vllm", "vllm_server")
"""Backends whose model is loaded by vLLM, not here: evaluation only needs the tokenizer."""


def _load(
    model: Any, tokenizer: Any, precision: str | None, backend: str
) -> tuple[Any, Any, str, str | None]:
    """(model or None for vLLM, tokenizer, display name, local path for vLLM)."""
    if isinstance(model, tuple):
        model, tokenizer = model
    if isinstance(model, (str, Path)):
        name = str(model)
        if backend in _SERVED:
            path = resolve_model_path(name)
            return None, tokenizer or load_tokenizer(path), name, path
        loaded, loaded_tokenizer = load_model_and_tokenizer(name, precision or "auto")
        return loaded, tokenizer or loaded_tokenizer, name, None
    if backend in _SERVED:
        raise ValueError(
            f"the {backend} backend's model is loaded by vLLM: pass a model path or name, not an object"
        )
    if tokenizer is None:
        raise ValueError(
            "pass the tokenizer along with an in-memory model (tokenizer=... or (model, tokenizer))"
        )
    name = str(getattr(model, "name_or_path", None) or type(model).__name__)
    if precision is not None and resolve_dtype(precision) != model.dtype:
        # Training on a CPU keeps fp32 weights; a bf16 copy generates ~4x faster where the CPU has AMX.
        logger.info("evaluating a %s copy of the %s model", resolve_dtype(precision), model.dtype)
        model = copy.deepcopy(model).to(resolve_dtype(precision))
    return model, tokenizer, name, None


def _prompt_ids(
    tokenizer: Any,
    records: Sequence[Mapping[str, Any]],
    system_prompt: str | None,
    few_shot: Sequence[Mapping[str, Any]],
    tool: Any = None,
    samples: int = 1,
    template_kwargs: Mapping[str, Any] | None = None,
) -> list[list[int]]:
    """Token ids per record: its own ``prompt`` (messages, or already-templated text) or a built one.

    With TRL's chat tool protocol each prompt is rendered with the tools its row may call (their
    JSON schemas, as TRL renders them into training prompts). ``template_kwargs`` reach the chat
    template (a GRPO stage's ``chat_template_kwargs``, when its pass rates are scored)."""
    template_kwargs = dict(template_kwargs or {})
    ids: list[list[int] | None] = [None] * len(records)
    chats, chat_rows = [], []
    for row, record in enumerate(records):
        prompt = record.get("prompt")
        if isinstance(prompt, str):
            ids[row] = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        else:
            chats.append(prompt or build_prompt(record["question"], system_prompt, few_shot))
            chat_rows.append(row)
    if isinstance(tool, ChatToolLoop):
        encoded = [
            encode_prompts(tokenizer, [c], tools=tool.tools_for(r * samples), **template_kwargs)[0]
            for c, r in zip(chats, chat_rows, strict=True)
        ]
    else:
        encoded = encode_prompts(tokenizer, chats, **template_kwargs) if chats else []  # may all be text
    for row, prompt_ids in zip(chat_rows, encoded, strict=True):
        ids[row] = prompt_ids
    return ids  # type: ignore[return-value]


def _completion_texts(tokenizer: Any, groups: Sequence[Sequence[Completion]], tool: Any) -> list[list[str]]:
    """Decoded completions per question. In TRL's chat tool protocol only the model's own tokens are
    scored (tool messages are the tool's text, as TRL's rewards skip them); inline tool tokens are
    part of the model's sentence (``48/2 = 24``) and stay."""
    model_only = isinstance(tool, ChatToolLoop)
    ids = [
        [t for t, m in zip(c.token_ids, c.env_mask, strict=True) if m]
        if model_only and c.env_mask
        else c.token_ids
        for g in groups
        for c in g
    ]
    decoded = iter(tokenizer.batch_decode(ids, skip_special_tokens=True))
    return [[next(decoded) for _ in group] for group in groups]


def sample_seed(seed: int, example_id: str, index: int) -> int:
    """A 63-bit seed per (run seed, example, sample): stable across processes and batch layouts.

    >>> sample_seed(0, "test-00001", 0) == sample_seed(0, "test-00001", 0) != sample_seed(0, "test-00001", 1)
    True
    """
    digest = hashlib.sha256(f"{seed}:{example_id}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _generate_hf(
    model: Any,
    tokenizer: Any,
    records: Sequence[Mapping[str, Any]],
    prompts: list[list[int]],
    cfg: EvalConfig,
    samples: int,
    refill_at: float,
    progress: bool,
    tool: Any,
) -> tuple[list[list[Completion]], GenerationStats]:
    requests = [p for p in prompts for _ in range(samples)]
    seeds = [sample_seed(cfg.seed, r["id"], j) for r in records for j in range(samples)]
    was_training = model.training
    model.eval()  # dropout off; the caller's mode is restored after
    try:
        flat, stats = generate_continuous(
            model,
            requests,
            max_new_tokens=cfg.max_completion_length,
            stop_ids=stop_token_ids(model, tokenizer),
            pad_token_id=pad_token_id(tokenizer),
            batch_size=cfg.batch_size,
            temperature=cfg.temperature,
            seeds=seeds,
            refill_at=refill_at,
            progress=progress,
            desc="eval",
            tool=tool,
        )
    finally:
        model.train(was_training)
    return [flat[i * samples : (i + 1) * samples] for i in range(len(records))], stats


def _meta(model: Any) -> dict[str, Any]:
    import torch
    import transformers

    meta = {
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    if model is not None:
        meta.update(
            dtype=str(getattr(model, "dtype", "?")).removeprefix("torch."),
            device=str(getattr(model, "device", "?")),
        )
    return meta


def evaluate(
    model: Any,
    dataset: Any,
    cfg: EvalConfig | None = None,
    *,
    tokenizer: Any = None,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    few_shot: Sequence[Mapping[str, Any]] = (),
    precision: str | None = None,
    num_samples: int | None = None,
    data_name: str | None = None,
    data_info: Mapping[str, Any] | None = None,
    refill_at: float = DEFAULT_REFILL_AT,
    progress: bool = False,
    server: ServerAddress | None = None,
    template_kwargs: Mapping[str, Any] | None = None,
) -> EvalReport:
    """Generate for and score every example of ``dataset``; return the report.

    ``model`` is a name/path (built-in, local dir, ``.gguf``, hub id; loaded at ``precision``, default
    ``auto``), an in-memory model with ``tokenizer=``, or a ``(model, tokenizer)`` pair. An in-memory
    model is used as it is unless ``precision`` is given; then a copy in that precision is evaluated.
    ``dataset`` is a list of records or a ``datasets.Dataset`` with ``id, question, answer`` and
    optionally ``prompt`` (chat messages, or already-templated text); otherwise the prompt is built
    from ``system_prompt`` and ``few_shot``. ``cfg.limit`` keeps the first N. ``num_samples``
    (default ``cfg.pass_k``) samples are drawn per question when ``cfg.temperature > 0``; pass@k uses
    all of them. ``data_info`` (:func:`~posttrain.data.eval_sets.eval_set_info`) says in the report
    which dataset and split the questions are.

    With ``cfg.backend == "vllm_server"``, ``server`` is the running server that serves ``model``
    (the pipeline's eval step starts it: :mod:`posttrain.evaluation.served`); ``model`` is then
    only read for its tokenizer. ``template_kwargs`` reach the chat template of every prompt posttrain
    renders (a GRPO stage's ``chat_template_kwargs``, so its pass rates are scored on its prompts).
    """
    cfg = cfg or EvalConfig()
    samples = num_samples or cfg.pass_k
    if samples < cfg.pass_k:
        raise ValueError(f"pass@{cfg.pass_k} needs at least {cfg.pass_k} samples per question, got {samples}")
    if samples > 1 and cfg.temperature == 0:
        raise ValueError("several samples per question need temperature > 0 (greedy samples are identical)")
    if cfg.backend == "vllm":
        from posttrain.generation.vllm import check_vllm

        check_vllm()  # fail before loading anything
    if cfg.backend == "vllm_server" and server is None:
        raise ValueError(
            "eval.backend: vllm_server generates through a running server: pass server= "
            "(posttrain run starts it from the config's vllm_server: section)"
        )
    records = _records(dataset, cfg.limit)
    start = time.perf_counter()
    model, tokenizer, name, vllm_path = _load(model, tokenizer, precision, cfg.backend)
    load_seconds = time.perf_counter() - start
    tool = (
        make_tool(
            cfg.tools,
            cfg.tool_protocol,
            tokenizer,
            stop_ids=sorted(stop_token_ids(model, tokenizer)),
            environment_factory=cfg.environment_factory,
            rows=[r for r in records for _ in range(samples)],
            template_kwargs=template_kwargs,
        )
        if cfg.backend == "hf"
        else None
    )
    prompts = _prompt_ids(tokenizer, records, system_prompt, few_shot, tool, samples, template_kwargs)
    if cfg.backend == "vllm_server":
        assert server is not None
        groups, stats = generate_via_server(
            server,
            prompts,
            max_new_tokens=cfg.max_completion_length,
            stop_ids=stop_token_ids(None, tokenizer),
            samples=samples,
            temperature=cfg.temperature,
            seed=cfg.seed,
        )
    elif vllm_path is not None:
        from posttrain.generation.vllm import generate_vllm

        stop = stop_token_ids(None, tokenizer)
        groups, stats = generate_vllm(
            vllm_path,
            prompts,
            max_new_tokens=cfg.max_completion_length,
            stop_ids=stop,
            samples=samples,
            temperature=cfg.temperature,
            seed=cfg.seed,
            precision=precision or "auto",
        )
    else:
        groups, stats = _generate_hf(
            model, tokenizer, records, prompts, cfg, samples, refill_at, progress, tool
        )
    scoring_start = time.perf_counter()
    texts = _completion_texts(tokenizer, groups, tool)
    scored = [
        [
            score_completion(
                text,
                record["answer"],
                tokens=c.num_tokens,
                truncated=not c.finished,
                tool_calls=c.tool_calls,
                tool_failures=c.tool_failures,
            )
            for text, c in zip(group_texts, group, strict=True)
        ]
        for record, group, group_texts in zip(records, groups, texts, strict=True)
    ]
    report_records = tuple(
        EvalRecord.from_samples(
            r["id"], r["question"], canonical_gold(r["answer"]), s, ops=_ops(r.get("ops"))
        )
        for r, s in zip(records, scored, strict=True)
    )
    summary = summarize(scored, cfg.pass_k, tools=cfg.uses_tools())
    summary |= lm_eval_accuracy(texts, [str(r["answer"]) for r in records])  # what lm-eval would report
    timings = {
        **stats.as_dict(),
        "load_seconds": round(load_seconds, 3),
        "scoring_seconds": round(time.perf_counter() - scoring_start, 3),
    }
    config = {
        **cfg.model_dump(mode="json"),
        "data_source": data_name or cfg.data,
        **({"dataset": dict(data_info)} if data_info else {}),
        "num_samples": samples,
        "system_prompt": system_prompt,
        "few_shot": len(few_shot),
        "precision": precision,
        "refill_at": refill_at,
    }
    report = EvalReport(
        model=name, summary=summary, records=report_records, config=config, timings=timings, meta=_meta(model)
    )
    logger.info(
        "eval %s: strict %.1f%%, flexible %.1f%%, format %.1f%% on %d examples (%.0f tok/s)%s",
        name,
        100 * summary["accuracy_strict"],
        100 * summary["accuracy_flexible"],
        100 * summary["strict_format_rate"],
        len(records),
        stats.tokens_per_second,
        f", with {', '.join(cfg.tools)}: {summary['tool_calls_per_completion']:.2f} calls per completion"
        if cfg.uses_tools()
        else "",
    )
    if report.by_ops:
        logger.info(
            "eval %s by operations (strict): %s",
            name,
            ", ".join(f"{ops}: {m['accuracy_strict']:.0%} of {m['n']}" for ops, m in report.by_ops.items()),
        )
    return report


def _ops(value: Any) -> int | None:
    """A record's difficulty as an int (None when its source gives none)."""
    return None if value is None else int(value)


def run_eval(
    model: str,
    data: str,
    limit: int | None = None,
    output_dir: str | Path | None = None,
    cfg: EvalConfig | None = None,
    *,
    precision: str = "auto",
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    progress: bool = True,
) -> EvalReport:
    """The ``posttrain eval`` entry point: evaluate ``model`` on ``data`` and optionally save the report.

    ``data`` is ``hub`` (GSM8K test from the hub), ``hub:<split>``, ``synthetic`` (generated problems),
    or a path to a GSM8K-format ``.jsonl`` file or folder. ``limit`` (default ``cfg.limit``) keeps
    the first N questions. ``output_dir`` receives ``report.json`` and ``examples.jsonl``.
    """
    cfg = cfg or EvalConfig()
    # Record in the report's config what was actually evaluated, not the pipeline default (heldout).
    update = parse_data_arg(data, cfg.hub_split)
    if limit is not None:
        update["limit"] = limit
    cfg = cfg.model_copy(update=update)
    data_name, records = eval_records_for(data, cfg.limit, cfg.hub_split)
    report = evaluate(
        model,
        records,
        cfg,
        precision=precision,
        system_prompt=system_prompt,
        data_name=data_name,
        data_info=eval_set_info(cfg.data, len(records), path=cfg.path, hub_split=cfg.hub_split),
        progress=progress,
    )
    if output_dir is not None:
        report.save(output_dir)
    return report
