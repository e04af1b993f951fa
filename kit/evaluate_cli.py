"""``kit evaluate ...``: the evaluation notebook's three calls from a terminal.

::

    kit evaluate finetune ./final --task ner --task ncc --seeds 3 --no-baselines --data ner=./wikiann
    kit evaluate series ./checkpoints --task ner --heldout heldout.txt --max-points 8 --output out/
    kit evaluate mlm neuropark/sahajBERT@main --heldout heldout.txt

What is printed on stdout is the product (the table, or one JSON line per result); logs go to
stderr. Heavy imports (torch, transformers, datasets) happen only when a command runs, so that
``kit --help`` stays fast. Nothing but argument parsing and printing lives here.
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

logger = logging.getLogger(__name__)


def add_command(subparsers: Any) -> None:
    """Register ``kit evaluate`` and its sub-commands."""
    parser = subparsers.add_parser(
        "evaluate",
        help="fine-tune checkpoints on Bengali NER/news tasks, plot a run's progress",
        description="Evaluate checkpoints like sahajBERT: downstream fine-tuning over seeds, "
        "checkpoint series plots, held-out masked-LM loss.",
    )
    parser.set_defaults(handler=lambda args: (parser.print_help(), 2)[1])
    commands = parser.add_subparsers(dest="evaluate_command", metavar="WHAT")

    finetune = commands.add_parser("finetune", help="mean ± std table over seeds, with baselines")
    finetune.add_argument("models", nargs="+", help="checkpoint folders or Hub ids (repo@rev)")
    _add_task_options(finetune, default_seeds=3)
    finetune.add_argument(
        "--baseline",
        action="append",
        default=None,
        metavar="REPO",
        help="Hub model to compare with (repeatable; default: the paper's)",
    )
    finetune.add_argument("--no-baselines", action="store_true", help="fine-tune no baseline")
    finetune.add_argument("--paper", action="store_true", help="append the paper's numbers")
    finetune.set_defaults(handler=_run_finetune)

    series = commands.add_parser("series", help="metrics of every checkpoint vs training step")
    series.add_argument("source", help="coordinator checkpoint folder or Hub repo id")
    _add_task_options(series, default_seeds=1)
    series.add_argument("--heldout", help="text file (one document per line) for the MLM loss")
    series.add_argument("--max-points", type=int, help="evaluate at most this many checkpoints")
    series.add_argument("--revision", help="Hub branch whose commits to list")
    series.add_argument("--tokenizer", help="tokenizer folder or repo for every checkpoint")
    series.set_defaults(handler=_run_series)

    mlm = commands.add_parser("mlm", help="held-out masked-LM loss and perplexity")
    mlm.add_argument("models", nargs="+", help="checkpoint folders or Hub ids (repo@rev)")
    mlm.add_argument("--heldout", required=True, help="text file, one document per line")
    mlm.add_argument("--seed", type=int, default=0, help="masking seed (default 0)")
    mlm.add_argument("--mask-probability", type=float, default=0.15)
    mlm.add_argument("--max-length", type=int, default=128)
    mlm.add_argument("--device", default="auto", help="auto, cpu, cuda, mps")
    mlm.set_defaults(handler=_run_mlm)


def _add_task_options(parser: argparse.ArgumentParser, default_seeds: int) -> None:
    parser.add_argument(
        "--task",
        action="append",
        default=None,
        metavar="TASK",
        help="ner or ncc (repeatable; default: ner and ncc, series: ner)",
    )
    parser.add_argument("--seeds", type=int, default=default_seeds, help="runs per model/task")
    parser.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="TASK=PATH",
        help="local dataset folder for a task (default: the real dataset)",
    )
    parser.add_argument("--epochs", type=int, help="FinetuneConfig.num_epochs")
    parser.add_argument("--lr", type=float, help="FinetuneConfig.learning_rate")
    parser.add_argument("--batch-size", type=int, help="FinetuneConfig.batch_size")
    parser.add_argument("--max-train", type=int, help="use only the first N training examples")
    parser.add_argument("--max-eval", type=int, help="use only the first N eval examples")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, mps")
    parser.add_argument("--output", default="evaluation", help="folder for JSON/CSV/PNG files")


def _config(args: argparse.Namespace) -> Any:
    from kit.evaluation.finetune import FinetuneConfig

    overrides = {
        "num_epochs": args.epochs,
        "learning_rate": args.lr,
        "batch_size": args.batch_size,
        "max_train_examples": args.max_train,
        "max_eval_examples": args.max_eval,
    }
    return FinetuneConfig(
        device=args.device, **{k: v for k, v in overrides.items() if v is not None}
    )


def _datasets(pairs: list[str]) -> dict[str, str]:
    from kit.errors import ConfigError

    sources = {}
    for pair in pairs:
        task, sep, path = pair.partition("=")
        if not sep or not path:
            raise ConfigError(
                f"--data expects TASK=PATH, got {pair!r} - help: --data ner=./wikiann"
            )
        sources[task] = path
    return sources


def _guarded(run: Any, args: argparse.Namespace) -> int:
    from kit.errors import ConfigError, EvaluationError

    try:
        return int(run(args))
    except (EvaluationError, ConfigError) as exc:
        logger.error("%s", exc)
        return 1


def _run_finetune(args: argparse.Namespace) -> int:
    def go(args: argparse.Namespace) -> int:
        from kit import evaluate

        baselines = () if args.no_baselines else (args.baseline or evaluate.DEFAULT_BASELINES)
        table = evaluate.compare(
            args.models,
            tasks=args.task or ("ner", "ncc"),
            seeds=args.seeds,
            baselines=baselines,
            datasets=_datasets(args.data),
            config=_config(args),
            output_dir=args.output,
        )
        print(table.format(paper=args.paper))
        return 0

    return _guarded(go, args)


def _run_series(args: argparse.Namespace) -> int:
    def go(args: argparse.Namespace) -> int:
        from kit import evaluate

        result = evaluate.evaluate_series(
            args.source,
            tasks=args.task or ("ner",),
            seeds=args.seeds,
            heldout_texts=args.heldout,
            max_points=args.max_points,
            datasets=_datasets(args.data),
            config=_config(args),
            output_dir=args.output,
            revision=args.revision,
            tokenizer=args.tokenizer,
        )
        for point in result.to_dict()["points"]:
            print(json.dumps(point, ensure_ascii=False))
        return 0

    return _guarded(go, args)


def _run_mlm(args: argparse.Namespace) -> int:
    def go(args: argparse.Namespace) -> int:
        from kit import evaluate

        for model in args.models:
            result = evaluate.masked_lm_loss(
                model,
                args.heldout,
                seed=args.seed,
                mask_probability=args.mask_probability,
                max_length=args.max_length,
                device=args.device,
            )
            print(
                json.dumps(
                    {
                        "model": result.model,
                        "loss": result.loss,
                        "perplexity": result.perplexity,
                        "masked_tokens": result.masked_tokens,
                    }
                )
            )
        return 0

    return _guarded(go, args)
