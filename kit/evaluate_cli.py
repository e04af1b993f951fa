"""``kit evaluate ...``: the evaluation notebook's three calls from a terminal.

::

    kit evaluate finetune --run ./demo                   # the run's checkpoints, by the device
    kit evaluate finetune ./final --task ner --task ncc --seeds 3 --no-baselines --data ner=./wikiann
    kit evaluate series ./checkpoints --task ner --heldout heldout.txt --max-points 8 --output out/
    kit evaluate mlm neuropark/sahajBERT@main --heldout heldout.txt

What is printed on stdout is the product (the table, or one JSON line per result); logs go to
stderr. ``finetune`` plans as the notebook does (``kit.evaluation.plan``): what is not given is
chosen by the device (a CPU: the quick profile, whose table says so in a column; a GPU: the
paper's protocol), and the plan is logged before anything long starts; ``--paper-protocol``
takes exactly what is given instead. ``series`` uses the quick profile's subset on a CPU too.
Heavy imports (torch, transformers, datasets) happen only when a command runs, so that ``kit
--help`` stays fast. Nothing but argument parsing and printing lives here.
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
    finetune.add_argument(
        "models",
        nargs="*",
        help="checkpoint folders or Hub ids (repo@rev); none: the run's (--run) first and newest "
        "on a CPU, its newest on a GPU",
    )
    finetune.add_argument(
        "--run",
        default=".",
        help="run folder (run.yaml and coordinator/, as kit demo --work-dir leaves it) or the "
        "run's Hub repo, whose checkpoints are judged when no model is named (default: .)",
    )
    _add_task_options(finetune, default_seeds=None)
    finetune.add_argument(
        "--baseline",
        action="append",
        default=None,
        metavar="REPO",
        help="Hub model to compare with (repeatable; default: the paper's on a GPU, none on a CPU)",
    )
    finetune.add_argument(
        "--paper-protocol",
        action="store_true",
        help="the paper's protocol on any device: every example, up to 20 epochs, 3 seeds, the "
        "paper's baselines (days on a CPU)",
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


def _add_task_options(parser: argparse.ArgumentParser, default_seeds: int | None) -> None:
    parser.add_argument(
        "--task",
        action="append",
        default=None,
        metavar="TASK",
        help="ner or ncc (repeatable; default: ner and ncc, series: ner)",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=default_seeds,
        help=f"runs per model/task (default: {default_seeds or '1 on a CPU, 3 on a GPU'})",
    )
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


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The ``FinetuneConfig`` fields given on the command line."""
    given = {
        "device": args.device,
        "num_epochs": args.epochs,
        "learning_rate": args.lr,
        "batch_size": args.batch_size,
        "max_train_examples": args.max_train,
        "max_eval_examples": args.max_eval,
    }
    return {k: v for k, v in given.items() if v is not None}


def _config(args: argparse.Namespace) -> Any:
    from kit.evaluation.finetune import FinetuneConfig

    return FinetuneConfig(**_overrides(args))


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
        from kit.errors import ConfigError

        tasks = args.task or ("ner", "ncc")
        datasets = _datasets(args.data)
        if args.paper_protocol:
            if not args.models:
                raise ConfigError(
                    "--paper-protocol needs the models to judge - help: name checkpoint folders "
                    "or Hub ids, or leave --paper-protocol out to judge the run's checkpoints"
                )
            baselines = () if args.no_baselines else (args.baseline or evaluate.DEFAULT_BASELINES)
            seeds = 3 if args.seeds is None else args.seeds  # (0 is refused by compare)
            models, config, protocol = args.models, _config(args), None
        else:
            plan = evaluate.plan_evaluation(
                args.models or None,
                tasks=tasks,
                seeds=args.seeds,
                baselines=() if args.no_baselines else args.baseline,
                finetune=_overrides(args),
                datasets=datasets,
                run=args.run,
            )
            logger.info("%s", plan.text())  # on stderr, before anything long starts
            models, seeds, baselines = plan.checkpoints, plan.seeds, plan.baselines
            config, protocol = plan.config, plan.protocol
        table = evaluate.compare(
            models,
            tasks=tasks,
            seeds=seeds,
            baselines=baselines,
            datasets=datasets,
            config=config,
            output_dir=args.output,
            protocol=protocol,
        )
        print(table.format(paper=args.paper))
        return 0

    return _guarded(go, args)


def _run_series(args: argparse.Namespace) -> int:
    def go(args: argparse.Namespace) -> int:
        from kit import evaluate
        from kit.evaluation.checkpoints import resolve_device
        from kit.evaluation.plan import config_for_device

        device = str(resolve_device(args.device).type)
        config = config_for_device(_overrides(args), device=device)
        if device == "cpu":  # the quick profile, as the notebook's series
            logger.info(
                "on a CPU: at every checkpoint the first %s training and %s evaluation examples "
                "of each task, %d epoch(s) (the quick profile, with what you gave on top)",
                config.max_train_examples or "all",
                config.max_eval_examples or "all",
                config.num_epochs,
            )
        result = evaluate.evaluate_series(
            args.source,
            tasks=args.task or ("ner",),
            seeds=args.seeds,
            heldout_texts=args.heldout,
            max_points=args.max_points,
            datasets=_datasets(args.data),
            config=config,
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
