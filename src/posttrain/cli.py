"""`posttrain` command line: the only module that prints.

Every command turns expected failures (bad config, bad data, missing hardware or model) into one
line on stderr and exit code 2, so scripts and schedulers see a clean failure, not a traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

EXIT_USAGE = 2


class CLIError(Exception):
    """An expected failure reported as one line."""


def _expected_errors() -> tuple[type[BaseException], ...]:
    from posttrain.config import ConfigError
    from posttrain.data.gsm8k import DataError
    from posttrain.training.modeling import ModelError

    return (CLIError, ConfigError, DataError, ModelError, FileNotFoundError)


# --------------------------------------------------------------------------- formatting


def format_table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    cells = [[str(c) for c in header]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


# --------------------------------------------------------------------------- commands


def cmd_validate(args: argparse.Namespace) -> int:
    from posttrain.config import load_config

    for path in args.configs:
        cfg = load_config(path, args.set)
        stages = " -> ".join(cfg.stage_names()) or "(no training stages)"
        print(f"ok  {path}: {cfg.model.name}; {stages}; eval on {cfg.eval.data}")
    return 0


def _data_config_for(target: str, overrides: Sequence[str]):
    """A YAML config's data section, or a local-JSONL data section for a .jsonl file or folder."""
    from posttrain.config import DataConfig, load_config

    path = Path(target)
    if path.suffix in {".yaml", ".yml"}:
        cfg = load_config(path, overrides)
        return cfg.data, cfg.model.name
    if not path.exists():
        raise CLIError(f"{target}: no such config, JSONL file or folder")
    return DataConfig(source="local", path=str(path), on_bad_record="error"), None


def cmd_data_preview(args: argparse.Namespace) -> int:
    from posttrain.data.prepare import prepare_data
    from posttrain.data.prompts import format_sft_target

    data_cfg, model_name = _data_config_for(args.target, args.set)
    tokenizer = None
    tokenizer_name = args.tokenizer or model_name
    if tokenizer_name:
        from posttrain.training.modeling import load_tokenizer, resolve_model_path

        tokenizer = load_tokenizer(resolve_model_path(tokenizer_name))
    prepared = prepare_data(data_cfg, tokenizer=tokenizer)
    for example in prepared.train.select(range(min(args.n, len(prepared.train)))):
        print(f"=== {example['id']}  (gold answer: {example['answer']}, steps: {example['steps']})")
        for message in example["prompt"]:
            print(f"[{message['role']}]\n{message['content']}")
        print(f"[sft target]\n{format_sft_target(example['solution'])}\n")
    stats = {k: v for k, v in prepared.stats.items() if not isinstance(v, dict)}
    print(format_table([(k, v) for k, v in stats.items()], ("count", "value")))
    if tokenizer is None:
        print("(prompt lengths not checked: pass --tokenizer MODEL or a config to drop long prompts)")
    return 0


def cmd_rewards_list(args: argparse.Namespace) -> int:
    from posttrain.rewards.registry import reward_names

    print("\n".join(reward_names()))
    return 0


def cmd_rewards_check(args: argparse.Namespace) -> int:
    from posttrain.config import load_config
    from posttrain.data.gsm8k import load_records
    from posttrain.data.prompts import format_sft_target
    from posttrain.rewards.check import INTENDED_BEST, ranks_as_intended, score_examples
    from posttrain.rewards.registry import build_reward

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
        best = next(r for r in rows if r.label == INTENDED_BEST)
        rivals = [
            r.label
            for r in rows
            if r is not best and not r.label.startswith("reference") and r.total >= best.total
        ]
        if not rivals and ranks_as_intended(rows):
            print(f"ok: '{INTENDED_BEST}' ranks strictly highest")
        elif rivals == ["wrong+formatted"]:
            print(
                f"note: '{INTENDED_BEST}' ties 'wrong+formatted': this stage rewards format, not correctness"
            )
        else:
            print(f"WARNING: {', '.join(rivals)} score at least as high as '{INTENDED_BEST}'")
            status = 1
    return status


def cmd_models_pull(args: argparse.Namespace) -> int:
    from posttrain.training.modeling import pull_builtin

    path = pull_builtin(args.name, args.cache_dir, force=args.force)
    print(f"{args.name}: {path}")
    return 0


def cmd_models_list(args: argparse.Namespace) -> int:
    from posttrain.training.modeling import list_models

    rows = [(m["name"], m["pulled"], m["size_mb"], m["description"]) for m in list_models(args.cache_dir)]
    print(format_table(rows, ("name", "pulled", "MB", "description")))
    return 0


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="posttrain", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_set(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="override a config value, e.g. grpo.stages.1.trainer.learning_rate=1e-5",
        )

    p = sub.add_parser("validate", help="load and validate pipeline configs")
    p.add_argument("configs", nargs="+")
    with_set(p)
    p.set_defaults(func=cmd_validate)

    data = sub.add_parser("data", help="dataset preparation").add_subparsers(
        dest="data_command", required=True
    )
    p = data.add_parser(
        "preview", help="show formatted prompts and counts for a config or a GSM8K JSONL file"
    )
    p.add_argument("target", help="a pipeline config (.yaml) or a GSM8K-format .jsonl file/folder")
    p.add_argument("-n", type=int, default=2, help="examples to show")
    p.add_argument("--tokenizer", help="model whose tokenizer measures prompt length (default: the config's)")
    with_set(p)
    p.set_defaults(func=cmd_data_preview)

    rewards = sub.add_parser("rewards", help="reward functions").add_subparsers(
        dest="rewards_command", required=True
    )
    p = rewards.add_parser("list", help="registered reward names")
    p.set_defaults(func=cmd_rewards_list)
    p = rewards.add_parser("check", help="score example completions with every configured reward")
    p.add_argument("config")
    p.add_argument("--references", type=int, default=3, help="reference solutions to score too")
    with_set(p)
    p.set_defaults(func=cmd_rewards_check)

    models = sub.add_parser("models", help="built-in models").add_subparsers(
        dest="models_command", required=True
    )
    p = models.add_parser("pull", help="fetch and convert a built-in model once")
    p.add_argument("name")
    p.add_argument("--force", action="store_true", help="fetch and convert again")
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=cmd_models_pull)
    p = models.add_parser("list", help="built-in models and whether they are pulled")
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=cmd_models_list)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    try:
        return args.func(args)
    except _expected_errors() as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
