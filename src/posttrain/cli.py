"""`posttrain` command line: the only module that prints.

Every command turns expected failures (bad config, bad data, missing hardware or model) into one
line on stderr and exit code 2, so scripts and schedulers see a clean failure, not a traceback:
:func:`user_error_line` is the last line of defence, which also maps what a user's input or machine
causes deep inside a library (text that is not UTF-8, input nested past Python's recursion limit, a
name too long for the file system, a full disk under safetensors or SQLite, a permission). The
traceback is printed only with ``--debug``; an error posttrain did not expect (a bug) keeps it.
Every line logged or printed passes through :func:`posttrain.core.redact.redact_text`.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import logging
import os
import re
import shutil
import signal
import sys
import threading
import traceback
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from posttrain.cache.store import Store, StoreError
from posttrain.core.checked import deferred_memos, flush_memos
from posttrain.core.config import DataConfig, EvalConfig, TrackingConfig
from posttrain.core.errors import DataError, HardwareError, PosttrainError
from posttrain.core.inputs import check_input_path, file_in_the_way, path_problem
from posttrain.core.library_policy import CUSTOM_CODE_ENV, allow_custom_code
from posttrain.core.metric_names import interval_names, slices_of
from posttrain.core.prompts import format_sft_target
from posttrain.core.quiet import one_line_per_library_record, quiet_library_warnings
from posttrain.core.redact import RedactingFormatter, redact_text, redacting_log_records
from posttrain.core.stats import format_percent
from posttrain.core.sweep import parse_seeds, point_labels, sweep_points
from posttrain.evaluation.diff import STAGE_VALUE_TITLE, stage_value_columns, stage_value_rows
from posttrain.flows.server import prefect_api_problem, prestart_embedded_prefect, use_embedded_prefect
from posttrain.generation.vllm_server import check_vllm_server
from posttrain.models.loading import load_tokenizer
from posttrain.models.resolve import list_models, names_a_local_path, pull_builtin, resolve_model_path
from posttrain.pipeline import load_config
from posttrain.pipeline.input_checks import tracking_uri_problem
from posttrain.pipeline.validation import managed_vllm_stages
from posttrain.rewards.check import judge, score_examples
from posttrain.rewards.registry import build_reward, reward_names

# Modules that import torch, datasets, Prefect or MLflow (seconds each) are imported inside the
# commands that use them, so `posttrain --help`, `validate` and `rewards list` stay quick.

logger = logging.getLogger(__name__)

EXIT_USAGE = 2
EXIT_TRACKING_LOST = 1
"""A run whose MLflow server went away: its steps' outputs are in the store, their logs are not."""
EXIT_INTERRUPTED = 128 + signal.SIGINT
EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(BaseException):
    """SIGTERM as an exception, as Ctrl-C is a KeyboardInterrupt: the run unwinds (its MLflow runs
    marked KILLED, files closed, exit handlers run) and says why it stopped, where the default
    disposition ends the process mid-line. Prefect's flow engine swaps in its own handler while a
    flow runs and, once it has marked the flow run crashed, hands the signal back to this one."""


def _raise_terminated(signum, frame):
    raise Terminated


@contextlib.contextmanager
def sigterm_raises_terminated():
    if threading.current_thread() is not threading.main_thread():  # only it may set handlers
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class CLIError(Exception):
    """An expected failure reported as one line."""


EXPECTED_ERRORS = (CLIError, PosttrainError, FileNotFoundError)
# Operating-system failures a user fixes outside posttrain (a full disk, a read-only mount, missing
# permissions, a name too long for the file system): one line naming the file, not a traceback.
EXPECTED_OS_ERRORS = {
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.ENAMETOOLONG,
    errno.ENOTDIR,
    errno.EISDIR,
    errno.ELOOP,
    errno.EEXIST,  # a folder wanted where a file is (`--plot data.jsonl/x.png`)
}
# What a full disk or a refused write looks like from libraries that do not raise OSError: the
# safetensors writer (Rust's io::Error text) and SQLite (MLflow's tracking database).
_DISK_MESSAGES = (
    "no space left on device",
    "os error 28",
    "database or disk is full",
    "disk i/o error",
    "attempt to write a readonly database",
    "unable to open database file",
    "disk quota exceeded",
    "read-only file system",
    "permission denied",
)


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or during (libraries wrap: MLflow wraps
    SQLAlchemy, which wraps sqlite3), outermost first, each once."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen and len(seen) < 32:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def user_error_line(exc: BaseException) -> str | None:
    """The one line for an error the user's input or machine caused, or None for anything else.

    >>> user_error_line(OSError(errno.ENAMETOOLONG, "File name too long", "x" * 3))
    'xxx: File name too long'
    >>> user_error_line(UnicodeDecodeError("utf-8", b"\\xff", 0, 1, "invalid start byte"))
    'input is not UTF-8 text (invalid start byte at byte 0): save files as UTF-8'
    >>> user_error_line(KeyError("bug")) is None
    True
    """
    if isinstance(exc, EXPECTED_ERRORS):
        return str(exc)
    for err in _chain(exc):
        if isinstance(err, PosttrainError | CLIError):
            return str(err)
        if isinstance(err, OSError) and err.errno in EXPECTED_OS_ERRORS:
            where = f"{err.filename}: " if err.filename else ""
            return f"{where}{err.strerror or err}"
        if isinstance(err, UnicodeDecodeError):
            return f"input is not UTF-8 text ({err.reason} at byte {err.start}): save files as UTF-8"
        if isinstance(err, RecursionError):
            return "input nested too deeply to process (Python's recursion limit); flatten it"
        name = type(err).__name__
        text = str(err).strip().splitlines()[0] if str(err).strip() else name
        text = re.sub(r"^\([\w.]+\)\s*", "", text)  # SQLAlchemy's "(sqlite3.OperationalError) ..." prefix
        is_library_io = name == "SafetensorError" or type(err).__module__.split(".")[0] in (
            "sqlite3",
            "sqlalchemy",
        )
        if is_library_io and any(m in text.lower() for m in _DISK_MESSAGES):
            what = (
                "saving weights (safetensors)"
                if name == "SafetensorError"
                else "the MLflow database (SQLite)"
            )
            return f"{what}: {text}"
    return None


# --------------------------------------------------------------------------- formatting


def format_table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    cells = [[str(c) for c in header]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def eval_table(outcomes: Sequence[dict], primary: str, width: int) -> str:
    """Strict accuracy after each evaluated stage, with its 95 % interval: the primary set (named
    ``primary``), each extra set, and per number of operations as far as ``width`` allows (extra sets'
    columns per number of operations are left out first, the last set's first, then the primary's).
    "" without evaluations."""
    low_name, high_name = interval_names("accuracy_strict")
    evals = [
        (o["step"].removeprefix("eval-"), slices_of(o["metrics"]), _bounds(o["metrics"], low_name, high_name))
        for o in outcomes
        if o["kind"] == "eval"
    ]
    if not evals:
        return ""
    seen = dict.fromkeys(s for _, slices, _ in evals for s in slices)
    sets = sorted(seen, key=lambda s: s is not None)  # the primary (None) first, then extra sets in order
    ops = {s: sorted({n for _, sl, _ in evals for n in sl.get(s, {}) if n is not None}) for s in sets}

    def label(eval_set: str | None, n: int | None) -> str:
        if n is None:
            return eval_set or primary
        return f"{eval_set} ops {n}" if eval_set else f"ops {n}"

    def table(per_ops: set[str | None]) -> str:
        columns = [(s, n) for s in sets for n in [None, *(ops[s] if s in per_ops else [])]]
        rows = [
            [stage, *(_percent(slices.get(s, {}).get(n), bounds.get((s, n))) for s, n in columns)]
            for stage, slices, bounds in evals
        ]
        return format_table(rows, ["stage", *(label(s, n) for s, n in columns)])

    shown = set(sets)
    text = table(shown)
    for drop in [*reversed(sets[1:]), None]:
        if max(len(line) for line in text.splitlines()) <= width:
            break
        shown.discard(drop)
        text = table(shown)
    title = "strict accuracy by evaluation set and number of operations"
    if any(bounds for _, _, bounds in evals):
        title += " [95% Wilson intervals]"
    return f"{title}:\n" + text


def stage_value_table(outcomes: Sequence[dict], changes: dict[str, float]) -> str:
    """What each training stage bought (:func:`posttrain.evaluation.diff.stage_value_rows`) as a
    table for the terminal; "" when no evaluation follows a stage with a known cost.

    >>> print(stage_value_table([{"step": "sft", "kind": "sft"}, {"step": "eval-sft", "kind": "eval"}],
    ...       {"eval-sft/stage_minutes": 4.0, "eval-sft/delta_accuracy_strict": 0.1,
    ...        "eval-sft/delta_accuracy_strict_ci_low": 0.05, "eval-sft/delta_accuracy_strict_ci_high": 0.15}))
    what each stage bought (strict accuracy, paired 95% interval on the same questions):
    stage  minutes  change (points)      points per minute
    -----  -------  -------------------  -----------------
    sft    4.0      +10.0 [+5.0, +15.0]  +2.50
    """
    rows = stage_value_rows(outcomes, changes)
    if not rows:
        return ""
    return f"{STAGE_VALUE_TITLE}:\n" + format_table(rows, stage_value_columns(changes))


def eval_sets_legend(outcomes: Sequence[dict], primary: str) -> str:
    """Which questions each evaluation set of the last evaluation holds (dataset, split, count), as
    its reports say: a number labelled GSM8K says which split it is on. "" without such reports."""
    from posttrain.evaluation.report import EvalReport

    evals = [o for o in outcomes if o["kind"] == "eval" and o.get("output")]
    if not evals:
        return ""
    folder = Path(evals[-1]["output"])
    sets = [(primary, folder)] + sorted(
        (p.name, p) for p in folder.iterdir() if p.is_dir() and (p / "report.json").is_file()
    )
    rows = []
    for name, where in sets:
        try:
            info = EvalReport.load(where).config.get("dataset")
        except (PosttrainError, OSError):
            continue
        if isinstance(info, dict) and isinstance(info.get("label"), str):
            rows.append((name, info["label"]))
    if not rows:
        return ""
    width = max(len(name) for name, _ in rows)
    return "evaluation sets:\n" + "\n".join(f"  {name:<{width}}  {label}" for name, label in rows)


def _bounds(metrics: dict, low_name: str, high_name: str) -> dict[tuple[str | None, int | None], tuple]:
    """(set, ops) -> (low, high) of the intervals ``metrics`` holds."""
    lows, highs = slices_of(metrics, low_name), slices_of(metrics, high_name)
    return {
        (s, n): (low, highs[s][n])
        for s, values in lows.items()
        for n, low in values.items()
        if n in highs.get(s, {})
    }


def _percent(value: float | None, bounds: tuple[float, float] | None = None) -> str:
    return "-" if value is None else format_percent(value, *(bounds or (None, None)))


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


# --------------------------------------------------------------------------- commands


def cmd_validate(args: argparse.Namespace) -> int:
    for path in args.configs:
        cfg = load_config(path, args.set)
        stages = " -> ".join(cfg.stage_names()) or "(no training stages)"
        sets = "".join(f" + {s.name} ({s.data})" for s in cfg.eval.extra_sets)
        print(f"ok  {path}: {cfg.model.name}; {stages}; eval on {cfg.eval.data}{sets}")
    return 0


def _data_config_for(target: str, overrides: Sequence[str]):
    """A YAML config's data section, model name and GRPO stages' own sources, or a local-JSONL data
    section for a .jsonl file or folder."""
    path = Path(target)
    if path.suffix in {".yaml", ".yml"}:
        cfg = load_config(path, overrides)
        return cfg.data, cfg.model.name, cfg.stage_data_sources()
    if not path.exists():
        raise CLIError(f"{target}: no such config, JSONL file or folder")
    if problem := path_problem(path):
        raise CLIError(f"{target} {problem}")
    return DataConfig(source="local", path=str(path), on_bad_record="error"), None, {}


def cmd_data_preview(args: argparse.Namespace) -> int:
    from posttrain.data.prepare import prepare_data

    if args.set and Path(args.target).suffix not in {".yaml", ".yml"}:
        raise CLIError(f"--set applies to a config; {args.target} is data (preview a config to set its keys)")
    data_cfg, model_name, stage_sources = _data_config_for(args.target, args.set)
    tokenizer = None
    tokenizer_name = args.tokenizer or model_name
    if tokenizer_name:
        tokenizer = load_tokenizer(resolve_model_path(tokenizer_name))
    try:
        prepared = prepare_data(data_cfg, tokenizer=tokenizer, stage_sources=stage_sources)
    except DataError as exc:
        if model_name is not None or str(exc).startswith(args.target):
            raise
        # A file is previewed as a run with the default data section would read it.
        raise DataError(f"{args.target}: {exc} (preview it through a config to set data keys)") from None
    for example in prepared.train.select(range(min(args.n, len(prepared.train)))):
        print(f"=== {example['id']}  (gold answer: {example['answer']}, ops: {example['ops']})")
        for message in example["prompt"]:
            print(f"[{message['role']}]\n{message['content']}")
        print(f"[sft target]\n{format_sft_target(example['solution'])}\n")
    stats = {k: v for k, v in prepared.stats.items() if not isinstance(v, dict)}
    print(format_table([(k, v) for k, v in stats.items()], ("count", "value")))
    if tokenizer is None:
        print("(prompt lengths not checked: pass --tokenizer MODEL or a config to drop long prompts)")
    return 0


def cmd_data_fetch(args: argparse.Namespace) -> int:
    from posttrain.data.sources import save_hub_split

    hub_id, hub_config = FETCHABLE[args.dataset]
    if args.output:  # one split, to the named file
        wanted = [(args.split or "train", Path(args.output))]
    else:  # every split that is missing, to <dir>/<split>.jsonl
        folder = Path(args.dir or os.environ.get(GSM8K_DIR_ENV) or DEFAULT_GSM8K_DIR)
        wanted = [(split, folder / f"{split}.jsonl") for split in ([args.split] if args.split else SPLITS)]
    for _, output in wanted:  # every name checked before the hub is asked for anything
        if args.output:
            where = f"--output {args.output}"
        elif args.dir:
            where = f"--dir {args.dir}"
        else:
            where = (
                f"{GSM8K_DIR_ENV}={output.parent}" if os.environ.get(GSM8K_DIR_ENV) else str(output.parent)
            )
        if blocking := file_in_the_way(output.parent):
            raise CLIError(f"{where}: {blocking} is a file, not a folder")
        if output.exists() and (problem := path_problem(output, "file")):
            raise CLIError(f"{output} {problem}")
    for split, output in wanted:
        if output.exists() and not args.force:
            if args.output:
                raise CLIError(f"{output}: already exists; pass --force to replace it")
            print(f"{output}: already there (--force fetches it again)")
            continue
        count = save_hub_split(output, hub_id, hub_config, split)
        print(f"wrote {count} records of {hub_id} ({hub_config}, {split}) to {output}")
    return 0


def cmd_data_hold_out(args: argparse.Namespace) -> int:
    from posttrain.data.sources import hold_out_last

    for flag, output in (("--train", args.train), ("--test", args.test)):
        if Path(output).exists() and (problem := path_problem(output, "file")):
            raise CLIError(f"{flag} {output} {problem}")
        if Path(output).exists() and not args.force:
            raise CLIError(f"{output}: already exists; pass --force to replace it")
    kept, held = hold_out_last(args.source, args.last, args.train, args.test)
    print(f"wrote {kept} records to {args.train} and the last {held} to {args.test}")
    return 0


FETCHABLE = {"gsm8k": ("openai/gsm8k", "main")}
"""Datasets ``posttrain data fetch`` saves: name -> (hub id, hub config)."""
SPLITS = ("train", "test")
"""The splits ``posttrain data fetch`` saves when none is named."""
GSM8K_DIR_ENV = "GSM8K_DIR"
"""Where ``posttrain data fetch`` saves GSM8K's splits (``make demo`` reads them there too)."""
DEFAULT_GSM8K_DIR = "data/gsm8k"
"""The folder, in the working directory, that the shipped configs read GSM8K from."""


def cmd_config(args: argparse.Namespace) -> int:
    from posttrain.core.config_reference import config_sections, render_markdown, render_text, select

    sections = config_sections()
    if args.section is not None:
        chosen = [] if "" in args.section.split(".") else select(sections, args.section)
        if not chosen:
            names = ", ".join(s.path for s in sections if s.path and "." not in s.path)
            raise CLIError(f"config: no section or key {args.section!r}; sections: {names}")
        sections = chosen
    if args.markdown:
        print(render_markdown(sections), end="")
    else:
        print(render_text(sections, shutil.get_terminal_size(fallback=(100, 24)).columns - 1), end="")
    return 0


def cmd_rewards_list(args: argparse.Namespace) -> int:
    print("\n".join(reward_names()))
    return 0


def cmd_rewards_check(args: argparse.Namespace) -> int:
    from posttrain.data.sources import load_records

    cfg = load_config(args.config, args.set)
    groups = [(f"grpo stage '{s.name}'", s.rewards) for s in cfg.grpo.stages]
    if cfg.dpo is not None and cfg.dpo.enabled:
        groups.append(("dpo pair scoring", cfg.dpo.rewards))
    if not groups:
        raise CLIError(f"{args.config}: no GRPO stage or DPO section configures rewards")
    records = load_records(cfg.data).records[: args.references]
    references = [(format_sft_target(r["solution"]), r["answer"]) for r in records]
    status = 0
    for title, specs in groups:
        rewards = [(spec.name, spec.weight, build_reward(spec.name, dict(spec.params))) for spec in specs]
        try:
            rows = score_examples(rewards, references)
        except (ValueError, RuntimeError) as exc:
            raise CLIError(f"{title}: {exc}") from exc
        header = ["completion", *[f"{name} (x{weight:g})" for name, weight, _ in rewards], "total"]
        print(f"\n{title}")
        print(format_table([(r.label, *r.scores.values(), r.total) for r in rows], header))
        verdict = judge(rows)
        print(verdict.message)
        status = max(status, int(verdict.failed))
    return status


def _check_servers(cfg, source: str) -> None:
    """The tracking store and a configured Prefect server answer, checked in seconds (MLflow and
    Prefect clients retry for minutes), before the store is locked or anything starts."""
    from posttrain.tracking import resolve_tracking_uri, tracking_problem

    if cfg.tracking.enabled and (problem := tracking_problem(cfg.tracking)):
        uri = resolve_tracking_uri(cfg.tracking)
        key = "tracking.tracking_uri" if cfg.tracking.tracking_uri else f"MLFLOW_TRACKING_URI={uri}"
        raise CLIError(f"{source}: {key}: {problem}")
    if problem := prefect_api_problem():
        raise CLIError(
            f"{source}: PREFECT_API_URL={os.environ['PREFECT_API_URL']}: {problem} "
            "(start it, or unset PREFECT_API_URL to use the embedded server)"
        )


def _check_machine(cfg, source: str) -> None:
    """What a config needs of this machine that only running it needs (a GPU config still
    validates on a laptop): a managed vLLM server's CUDA and vLLM, checked before the store is
    locked or a model loads."""
    if managed_vllm_stages(cfg) or cfg.eval.backend == "vllm_server":
        try:
            check_vllm_server()
        except HardwareError as exc:
            raise HardwareError(f"{source}: {exc}") from None


def _open_store(cfg, source: str) -> Store:
    try:
        store = Store.at(cfg.orchestration.store)
        store.check_writable()
    except StoreError as exc:
        raise CLIError(f"{source}: orchestration.store: {exc}") from None
    return store


@contextlib.contextmanager
def _locked(store: Store, source: str):
    try:
        lock = store.lock()
        lock.__enter__()
    except StoreError as exc:
        raise CLIError(f"{source}: orchestration.store: {exc}") from None
    try:
        yield
    finally:
        lock.__exit__(None, None, None)


def _pipeline_config(args: argparse.Namespace):
    """The validated config, with everything about it that can be known before anything starts:
    ``--force`` names steps of its plan, and its servers answer."""
    from posttrain.pipeline.plan import build_plan

    cfg = load_config(args.config, args.set)
    build_plan(cfg).check_force(getattr(args, "force", ()))
    return cfg


def cmd_run(args: argparse.Namespace) -> int:
    cfg = _pipeline_config(args)
    if args.dry_run:
        from posttrain.pipeline.plan import preview

        try:
            Store.at(cfg.orchestration.store, create=False).check_usable()  # as a run would, writing nothing
        except StoreError as exc:
            raise CLIError(f"{args.config}: orchestration.store: {exc}") from None
        rows = preview(cfg, args.force)  # reads records only: creates no store, starts no server
        print(format_table(rows, ("step", "plan", "why")))
        return 0
    _check_servers(cfg, args.config)
    _check_machine(cfg, args.config)
    store = _open_store(cfg, args.config)
    with _locked(store, args.config):
        flush_memos()  # the input is good: remember its checks even if the run fails later
        summary = None if os.environ.get("PREFECT_API_URL") else _run_cached(cfg, args.force)
        if summary is None:
            # The lock is held before Prefect's embedded server (whose home is in the store) starts.
            server = prestart_embedded_prefect(store)
            from posttrain.flows.pipeline_flow import posttrain_pipeline
            from posttrain.flows.server import quiet_run_failures_on_console
            from posttrain.tracking import open_tracking_store

            quiet_run_failures_on_console()
            open_tracking_store(cfg)  # overlaps the server's boot
            if server is not None:
                server.wait()
            summary = posttrain_pipeline(cfg, force=args.force)
    rows = [(o["step"], o["status"], _accuracy_cell(o), o["output"]) for o in summary["outcomes"]]
    print(format_table(rows, ("step", "status", "accuracy (strict) [95% CI]", "output")))
    width = shutil.get_terminal_size(fallback=(120, 24)).columns
    if table := eval_table(summary["outcomes"], cfg.eval.data, width):
        print("\n" + table)
        if legend := eval_sets_legend(summary["outcomes"], cfg.eval.data):
            print(legend)
    if bought := stage_value_table(summary["outcomes"], summary.get("changes", {})):
        print("\n" + bought)
    if summary["run_id"]:
        print(f"MLflow run {summary['run_id']} in experiment '{summary['experiment']}'")
    return 0


def _accuracy_cell(outcome: dict) -> str:
    """A step's strict accuracy with its interval ("" for steps that do not evaluate)."""
    metrics = outcome["metrics"]
    if outcome["kind"] != "eval" or "accuracy_strict" not in metrics:
        return ""
    low, high = interval_names("accuracy_strict")
    return format_percent(metrics["accuracy_strict"], metrics.get(low), metrics.get(high))


def _run_cached(cfg, force: Sequence[str]) -> dict | None:
    """The run's summary when every step is served from cache, done without the embedded Prefect
    server (whose boot is most of such a run); None when a step must run (nothing was done) or a
    step turned out not to be cached after all (then the flow runs it, and logs a new MLflow run)."""
    from posttrain.flows.plan_walker import StepNotCached, run_cached

    try:
        return run_cached(cfg, force)
    except StepNotCached as exc:
        logger.warning("%s: running the pipeline flow", exc)
        return None


def cmd_sweep(args: argparse.Namespace) -> int:
    """Run the pipeline once per point of the ``--set`` grid (one MLflow parent run each, cached
    stages shared through the store), then print the comparison of those runs."""
    overrides = list(args.set)
    if args.seeds is not None:
        if any(o.partition("=")[0].strip() == "seed" for o in overrides):
            raise CLIError("sweep: give --seeds or --set seed=..., not both")
        overrides.append("seed=" + ",".join(str(seed) for seed in parse_seeds(args.seeds)))
    points = sweep_points(overrides)
    if len(points) < 2:
        raise CLIError(
            "sweep: give at least one --set KEY=V1,V2 with two or more values, or --seeds with two or more"
        )
    configs = [load_config(args.config, point) for point in points]  # every point valid before any runs
    if len({c.orchestration.store for c in configs}) > 1:
        raise CLIError("sweep: orchestration.store cannot vary between points (one store, one lock)")
    if len({(c.tracking.enabled, c.tracking.tracking_uri) for c in configs}) > 1:
        raise CLIError("sweep: tracking.enabled/tracking_uri cannot vary between points (one comparison)")
    if args.parallel < 1:
        raise CLIError(f"sweep: --parallel {args.parallel}: give 1 or more points at a time")
    _check_servers(configs[0], args.config)
    for cfg in configs:
        _check_machine(cfg, args.config)
    store = _open_store(configs[0], args.config)
    with _locked(store, args.config):
        flush_memos()
        server = prestart_embedded_prefect(store)
        from posttrain.flows.server import quiet_run_failures_on_console
        from posttrain.flows.sweep_flow import run_sweep
        from posttrain.tracking import open_tracking_store

        quiet_run_failures_on_console()
        open_tracking_store(configs[0])
        if server is not None:
            server.wait()
        labels = point_labels(points, overrides)
        run_ids = run_sweep(configs, labels, parallel=args.parallel)
    if None in run_ids:
        print(f"{len(points)} points ran (tracking disabled: nothing to compare)")
        return 0
    from posttrain.tracking import compare_runs, format_comparison, resolve_tracking_uri

    comparison = compare_runs(run_ids=run_ids, tracking_uri=resolve_tracking_uri(configs[0].tracking))
    print(format_comparison(comparison))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from posttrain.evaluation import diff_reports, format_diff, format_summary_table, run_eval
    from posttrain.evaluation.report import REPORT_FILE, EvalReport

    if args.diff:
        if given := [f"--{f}" for f in ("model", "data", "output", "limit") if getattr(args, f) is not None]:
            raise CLIError(f"eval --diff compares two reports; {given[0]} applies to an evaluation")
        for folder in args.diff:
            check_input_path(folder, "--diff", "folder")
        a, b = (EvalReport.load(d) for d in args.diff)
        print(format_diff(diff_reports(a, b, mode=args.mode), n_examples=args.examples))
        # A pipeline evaluation holds each extra set's report in a folder named after the set.
        dir_a, dir_b = (Path(d) for d in args.diff)
        for folder in sorted(p for p in dir_a.iterdir() if (p / REPORT_FILE).is_file()):
            if (dir_b / folder.name / REPORT_FILE).is_file():
                a, b = EvalReport.load(folder), EvalReport.load(dir_b / folder.name)
                print(f"\nevaluation set {folder.name}:")
                print(format_diff(diff_reports(a, b, mode=args.mode), n_examples=args.examples))
        return 0
    if not args.model or not args.data:
        raise CLIError("eval needs --model and --data (or --diff A B)")
    _check_eval_paths(args)
    try:
        cfg = EvalConfig(
            max_completion_length=args.max_completion_length,
            batch_size=args.batch_size,
            backend=args.backend,
            limit=args.limit,
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        flag = "--" + str(err["loc"][0]).replace("_", "-") if err["loc"] else "eval"
        raise CLIError(f"{flag}: {err['msg']} (got {err.get('input')!r})") from None
    report = run_eval(args.model, args.data, args.limit, args.output, cfg, precision=args.precision)
    print(format_summary_table(report))
    if args.output:
        print(f"report: {Path(args.output) / 'report.json'} (+ examples.jsonl)")
    return 0


def _check_eval_paths(args: argparse.Namespace) -> None:
    """What ``eval`` reads and writes is usable, found before the model loads and the evaluation
    runs: a local ``--model`` or ``--data`` is a regular file or folder, and ``--output`` is a
    folder (or can become one) that can be written."""
    if names_a_local_path(args.model) or Path(args.model).expanduser().exists():  # a hub id is the hub's
        check_input_path(args.model, "--model")
    if args.data not in ("hub", "synthetic") and not args.data.startswith("hub:"):
        check_input_path(args.data, "--data")
    if args.output:
        output = Path(args.output).expanduser()
        if output.exists() and not output.is_dir():
            raise CLIError(
                f"--output {args.output}: is a file; give a folder for report.json and examples.jsonl"
            )
        parent = next((p for p in [output, *output.parents] if p.exists()), Path("."))
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise CLIError(f"--output {args.output}: cannot create or write {parent}")


def cmd_compare(args: argparse.Namespace) -> int:
    from posttrain.tracking import compare_runs, format_comparison, plot_comparison

    if args.run_ids and args.last:
        raise CLIError("give RUN_IDs or --last N, not both")
    if not args.promote and (
        only := [f for f in ("metric", "registered_model", "force") if getattr(args, f)]
    ):
        raise CLIError(f"--{only[0].replace('_', '-')} applies to --promote only")
    if blocking := file_in_the_way(Path(args.plot).expanduser().parent):
        raise CLIError(f"--plot {args.plot}: {blocking} is a file, not a folder")
    args.tracking_uri = _tracking_store_to_read(args.tracking_uri)
    comparison = compare_runs(
        args.experiment,
        last=None if args.run_ids else (args.last or 5),
        run_ids=args.run_ids,
        tracking_uri=args.tracking_uri,
    )
    if not comparison.runs:
        raise CLIError("no pipeline runs found (check --experiment and MLFLOW_TRACKING_URI)")
    print(format_comparison(comparison, show_all=args.all))
    png = plot_comparison(comparison, args.plot)
    print(f"plot: {png}")
    if args.promote:
        print(_promote(comparison, args))
    return 0


def _tracking_store_to_read(flag: str | None) -> str:
    """The tracking URI ``compare`` reads (``--tracking-uri``, else as a run resolves it), checked in
    seconds as ``run`` checks it (MLflow retries for minutes), and refused where no database exists
    yet: reading would create an empty one."""
    from posttrain.tracking import resolve_tracking_uri
    from posttrain.tracking.mlflow_io import sqlite_path, uri_problem

    uri = flag or resolve_tracking_uri(TrackingConfig())
    if flag:
        where = f"--tracking-uri {uri}"
    elif os.environ.get("MLFLOW_TRACKING_URI"):
        where = f"MLFLOW_TRACKING_URI={uri}"
    else:
        where = f"the default tracking store {uri}"
    problem = tracking_uri_problem(uri) or uri_problem(uri)
    db = sqlite_path(uri)
    if problem is None and db is not None and not db.exists():
        problem = f"no MLflow database at {db}: no run has been logged there (set --tracking-uri or MLFLOW_TRACKING_URI)"
    if problem:
        raise CLIError(redact_text(f"{where}: {problem}"))
    return uri


def _promote(comparison, args: argparse.Namespace) -> str:
    """``compare --promote``: move the champion alias to the best stage model of the compared runs."""
    from posttrain.tracking import models_of_runs, promote_champion, resolve_tracking_uri
    from posttrain.tracking.mlflow_io import mlflow_client

    uri = args.tracking_uri or resolve_tracking_uri(TrackingConfig())
    candidates = models_of_runs(mlflow_client(uri), [r.run_id for r in comparison.runs])
    try:
        promotion = promote_champion(
            uri,
            candidates,
            args.metric or "accuracy_strict",
            registered_model=args.registered_model,
            force=args.force,
        )
    except ValueError as exc:
        raise CLIError(f"--promote: {exc}") from None
    return promotion.message


def cmd_serve(args: argparse.Namespace) -> int:
    cfg = _pipeline_config(args)
    use_embedded_prefect(Store.at(cfg.orchestration.store, create=False))
    if not os.environ.get("PREFECT_API_URL"):
        raise CLIError(
            "schedules need a Prefect server: run `prefect server start`, then "
            "`export PREFECT_API_URL=http://127.0.0.1:4200/api` and serve again"
        )
    _check_servers(cfg, args.config)
    from posttrain.flows.pipeline_flow import posttrain_pipeline

    name = args.name or cfg.name
    print(f"serving deployment 'posttrain-pipeline/{name}' on cron '{args.cron}' (Ctrl-C stops)")
    posttrain_pipeline.serve(
        name=name,
        cron=args.cron,
        parameters={"config": cfg.model_dump(mode="json")},
        tags=["posttrain", cfg.name],
    )
    return 0


def _check_cache_dir(cache_dir: str | None) -> None:
    if cache_dir and Path(cache_dir).exists() and (problem := path_problem(cache_dir, "folder")):
        raise CLIError(f"--cache-dir {cache_dir} {problem}")


def cmd_models_pull(args: argparse.Namespace) -> int:
    _check_cache_dir(args.cache_dir)
    path = pull_builtin(args.name, args.cache_dir, force=args.force)
    print(f"{args.name}: {path}")
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    _check_cache_dir(args.cache_dir)
    rows = [(m["name"], m["pulled"], m["size_mb"], m["description"]) for m in list_models(args.cache_dir)]
    print(format_table(rows, ("name", "pulled", "MB", "description")))
    return 0


# --------------------------------------------------------------------------- parser

DESCRIPTION = """\
Post-train small language models for verifiable reasoning (GSM8K) from one YAML file: data
preparation, optional SFT and DPO, staged GRPO with composable rewards (TRL), and an evaluation
after each stage. Every step is cached (an unchanged config reruns nothing), every run is tracked
in MLflow, and a killed run resumes where it stopped."""

EPILOG = """\
start here:
  posttrain run configs/smoke.yaml            the whole pipeline on a tiny model
  posttrain run CONFIG --dry-run              which steps would run or come from cache, and why
  posttrain validate CONFIG                   check a config without running anything
  posttrain config grpo.stages                what each key of a section means
  posttrain compare --last 3                  compare the latest runs in MLflow

'posttrain COMMAND --help' describes a command."""


RENAMED_FLAGS = {"--max-new-tokens": "--max-completion-length"}
"""Flags that were renamed (old: new): the old name gets the new one in its error line, as a renamed
config key does."""


class UsageError(Exception):
    """A command line argparse cannot read, as one line (argparse's own error prints the usage too)."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors raised as :class:`UsageError` instead of a usage dump and exit."""

    def error(self, message: str):  # type: ignore[override]  # argparse's hook; never returns
        raise UsageError(f"{self.prog}: {message}")


def _unknown_flag_line(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """The error line of arguments ``parser`` (a command's) does not take: a renamed flag's new
    name, or the closest flag it has."""
    first = extras[0]
    flag = first.split("=", 1)[0]
    if not flag.startswith("-"):
        return f"{parser.prog}: unexpected argument {first!r}"
    if RENAMED_FLAGS.get(flag) in parser._option_string_actions:
        return f"{parser.prog}: {flag}: renamed to {RENAMED_FLAGS[flag]}"
    known = [option for option in parser._option_string_actions if option.startswith("--")]
    close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else f"'{parser.prog} --help' lists its flags"
    return f"{parser.prog}: unknown flag {flag}: {hint}"


def parse_arguments(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line as a namespace; a bad one is a :class:`UsageError` of one line."""
    args, extras = build_parser().parse_known_args(argv)
    if extras:
        raise UsageError(_unknown_flag_line(args.command_parser, extras))
    return args


def _at_least(minimum: int):
    """An argparse type: an integer no smaller than ``minimum`` (a negative count would silently
    slice from the end, ``--last 0`` would read as the default)."""

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return count


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="posttrain",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    parser.add_argument(
        "--debug", action="store_true", help="print the traceback of an error before its one-line message"
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def with_set(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config value, e.g. grpo.stages.1.trainer.learning_rate=1e-5",
        )
        p.add_argument(
            "--allow-custom-code",
            action="store_true",
            help=f"import custom 'package.module:function' rewards the config names (runs their code; "
            f"same as {CUSTOM_CODE_ENV}=1)",
        )

    p = sub.add_parser("validate", help="load and validate pipeline configs")
    p.add_argument("configs", nargs="+")
    with_set(p)
    p.set_defaults(command_parser=p, func=cmd_validate)

    p = sub.add_parser("config", help="the config reference: every key with its type, default and meaning")
    p.add_argument(
        "section", nargs="?", help="a section or key, e.g. grpo.stages, eval.extra_sets, model.precision"
    )
    p.add_argument("--markdown", action="store_true", help="markdown, as in docs/config.md")
    p.set_defaults(command_parser=p, func=cmd_config)

    data = sub.add_parser("data", help="datasets: save one from the hub, preview prompts").add_subparsers(
        dest="data_command", required=True
    )
    p = data.add_parser(
        "preview", help="show formatted prompts and counts for a config or a GSM8K JSONL file"
    )
    p.add_argument("target", help="a pipeline config (.yaml) or a GSM8K-format .jsonl file/folder")
    p.add_argument("-n", type=_at_least(1), default=2, help="examples to show")
    p.add_argument("--tokenizer", help="model whose tokenizer measures prompt length (default: the config's)")
    with_set(p)
    p.set_defaults(command_parser=p, func=cmd_data_preview)

    rewards = sub.add_parser("rewards", help="reward functions").add_subparsers(
        dest="rewards_command", required=True
    )
    p = data.add_parser(
        "fetch",
        help="save a dataset split from the Hugging Face Hub as a local .jsonl (for data.source: local)",
    )
    p.add_argument("dataset", choices=sorted(FETCHABLE), help="dataset to save")
    p.add_argument(
        "--split", default=None, choices=SPLITS, help="train or test (default: both, or train with --output)"
    )
    p.add_argument(
        "--dir",
        metavar="DIR",
        help=f"save each split as DIR/<split>.jsonl, keeping those already there (default: "
        f"${GSM8K_DIR_ENV}, else {DEFAULT_GSM8K_DIR})",
    )
    p.add_argument("--output", metavar="PATH", help="save the one split to this .jsonl file instead")
    p.add_argument("--force", action="store_true", help="replace files that exist")
    p.set_defaults(command_parser=p, func=cmd_data_fetch)
    p = data.add_parser(
        "hold-out",
        help="split a GSM8K file in two: its last N records stand in for a test split that cannot be "
        "fetched, the rest is trained on",
    )
    p.add_argument("source", help="a GSM8K-format .jsonl file (left unchanged)")
    p.add_argument("--last", type=int, required=True, metavar="N", help="records held out (GSM8K test: 1319)")
    p.add_argument("--train", required=True, metavar="PATH", help="where the other records go")
    p.add_argument("--test", required=True, metavar="PATH", help="where the last N records go")
    p.add_argument("--force", action="store_true", help="replace files that exist")
    p.set_defaults(command_parser=p, func=cmd_data_hold_out)

    p = rewards.add_parser("list", help="registered reward names")
    p.set_defaults(command_parser=p, func=cmd_rewards_list)
    p = rewards.add_parser("check", help="score example completions with every configured reward")
    p.add_argument("config")
    p.add_argument("--references", type=_at_least(0), default=3, help="reference solutions to score too")
    with_set(p)
    p.set_defaults(command_parser=p, func=cmd_rewards_check)

    p = sub.add_parser("run", help="run the pipeline (cached steps are reused)")
    p.add_argument("config")
    with_set(p)
    p.add_argument(
        "--force",
        action="append",
        default=[],
        metavar="STEP",
        help="rerun this step (data, sft, dpo, grpo-<name>, rft-<name>, score-<stage>) and everything after it",
    )
    p.add_argument("--dry-run", action="store_true", help="print which steps would run or be cached, and why")
    p.set_defaults(command_parser=p, func=cmd_run)

    p = sub.add_parser(
        "sweep",
        help="run the pipeline for every combination of --set KEY=V1,V2 values, then compare the runs",
    )
    p.add_argument("config")
    with_set(p)
    p.add_argument(
        "--parallel",
        type=int,
        default=1,
        metavar="N",
        help="run up to N points at a time (steps they share are made once; "
        "orchestration.gpu_slots bounds their steps on the device)",
    )
    p.add_argument(
        "--seeds",
        metavar="S1,S2,...",
        help="run the config once per seed (the same as --set seed=S1,S2,...); steps that do not depend "
        "on the seed (data, the baseline evaluation) are made once, and the comparison adds each "
        "stage's mean and 95%% t interval over the seeds",
    )
    p.set_defaults(command_parser=p, func=cmd_sweep)

    p = sub.add_parser("eval", help="evaluate a model on GSM8K-format data, or diff two reports")
    p.add_argument("--model", help="built-in name, hub id, model or stage directory, .gguf file")
    p.add_argument("--data", help="a GSM8K .jsonl file/folder, 'hub', 'hub:<split>' or 'synthetic'")
    p.add_argument("--limit", type=int, default=None, help="first N questions (fixed order)")
    p.add_argument("--output", help="directory for report.json and examples.jsonl")
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16", "fp16"])
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-completion-length", type=int, default=256)
    p.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    p.add_argument(
        "--diff",
        nargs=2,
        metavar=("A", "B"),
        help="compare two saved reports by example id (and the extra sets of two pipeline evaluations)",
    )
    p.add_argument("--mode", default="strict", choices=["strict", "flexible"], help="--diff: which accuracy")
    p.add_argument("--examples", type=_at_least(0), default=3, help="--diff: examples shown per group")
    p.set_defaults(command_parser=p, func=cmd_eval)

    p = sub.add_parser("compare", help="side-by-side table and plot of pipeline runs in MLflow")
    p.add_argument("run_ids", nargs="*", metavar="RUN_ID")
    p.add_argument("--experiment", help="MLflow experiment (default: all posttrain runs)")
    p.add_argument(
        "--last", type=_at_least(1), default=None, help="the N most recent pipeline runs (default 5)"
    )
    p.add_argument("--plot", default="compare.png", help="where to write the comparison PNG")
    p.add_argument(
        "--tracking-uri", default=None, help="default: $MLFLOW_TRACKING_URI or sqlite:///mlflow.db"
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="every metric of every stage (decode steps, timings, tool calls, per difficulty...), not "
        "only the headline accuracies and their intervals",
    )
    p.add_argument(
        "--promote",
        action="store_true",
        help="register the best stage model of these runs and move the 'champion' alias to it",
    )
    p.add_argument(
        "--metric",
        default=None,
        help="--promote: evaluation metric, higher is better (default accuracy_strict)",
    )
    p.add_argument(
        "--registered-model", default=None, help="--promote: registered model (default: config name)"
    )
    p.add_argument(
        "--force", action="store_true", help="--promote: move the alias even if the champion scores higher"
    )
    p.set_defaults(command_parser=p, func=cmd_compare)

    p = sub.add_parser("serve", help="schedule the pipeline as a Prefect deployment (needs a Prefect server)")
    p.add_argument("config")
    p.add_argument("--cron", required=True, help='e.g. "0 3 * * *"')
    p.add_argument("--name", help="deployment name (default: the config name)")
    with_set(p)
    p.set_defaults(command_parser=p, func=cmd_serve)

    models = sub.add_parser("models", help="built-in models").add_subparsers(
        dest="models_command", required=True
    )
    p = models.add_parser("pull", help="fetch and convert a built-in model once")
    p.add_argument("name")
    p.add_argument("--force", action="store_true", help="fetch and convert again")
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(command_parser=p, func=cmd_models_pull)
    p = models.add_parser("list", help="built-in models and whether they are pulled")
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(command_parser=p, func=cmd_models_list)
    return parser


def _quiet_prefect(level: int):
    def keep(record: logging.LogRecord) -> bool:
        return not record.name.startswith("prefect") or record.levelno >= max(level, logging.WARNING)

    return keep


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_arguments(argv)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    for handler in logging.getLogger().handlers:
        if type(handler.formatter) is logging.Formatter:  # basicConfig's: the same, redacted
            handler.setFormatter(RedactingFormatter(handler.formatter._fmt, handler.formatter.datefmt))
    for noisy in ("httpx", "httpcore", "alembic", "urllib3", "mlflow.system_metrics"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))
    # Prefect's own INFO lines still reach its UI (run logs); only the terminal leaves them out.
    for handler in logging.getLogger().handlers:
        handler.addFilter(_quiet_prefect(level))
    previous_opt_in = os.environ.get(CUSTOM_CODE_ENV)
    if getattr(args, "allow_custom_code", False):
        allow_custom_code()  # in the environment: the flow's worker processes see it too
    quiet_library_warnings()
    one_line_per_library_record()
    try:
        with redacting_log_records(), deferred_memos(), sigterm_raises_terminated():
            status = args.func(args)
            flush_memos()
            return status
    except Exception as exc:
        line = user_error_line(exc)
        if line is None:
            raise
        if args.debug:
            traceback.print_exception(exc, file=sys.stderr)
        print(f"error: {redact_text(' '.join(line.split()))}", file=sys.stderr)
        from posttrain.tracking import TrackingLost

        if any(isinstance(err, TrackingLost) for err in _chain(exc)):
            return EXIT_TRACKING_LOST  # the input was good and the work is done; the log is not
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print("terminated", file=sys.stderr)
        return EXIT_TERMINATED
    finally:
        if previous_opt_in is None:
            os.environ.pop(CUSTOM_CODE_ENV, None)
        else:
            os.environ[CUSTOM_CODE_ENV] = previous_opt_in


if __name__ == "__main__":
    sys.exit(main())
