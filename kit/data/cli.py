"""``kit tokenizer train --config run.yaml``: train, save (and optionally push) the run's tokenizer.

It holds the command-line wrapper only: read the ``tokenizer:`` and ``data:`` sections, stream
the chosen sources once (with the data filters), train the recipe, save the folder, push it if
asked, and print one JSON line summarizing the result. The recipe itself is in
kit.data.tokenizer; heavy imports happen inside the handler so ``kit --help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from pathlib import Path

from kit.errors import KitError

logger = logging.getLogger(__name__)


def add_command(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register ``kit tokenizer ...``."""
    parser = subparsers.add_parser("tokenizer", help="train the run's tokenizer (sahajBERT recipe)")
    actions = parser.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)
    train = actions.add_parser("train", help="train from the data sources of run.yaml and save it")
    train.add_argument(
        "--config", required=True, help="run.yaml with `tokenizer:` and `data:` sections"
    )
    train.add_argument("--output", help="folder to write (default: tokenizer.output_dir)")
    train.add_argument("--max-documents", type=int, help="stop after this many documents")
    train.add_argument(
        "--push", metavar="REPO_ID", help="push to this Hub repo (default: tokenizer.hub_repo)"
    )
    train.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    train.set_defaults(handler=_train)


def _train(args: argparse.Namespace) -> int:
    from huggingface_hub.errors import HfHubHTTPError

    from kit.config import DataConfig, TokenizerConfig

    from .tokenizer import push_tokenizer_to_hub, train_run_tokenizer

    try:
        tokenizer_config = TokenizerConfig.from_file(args.config)
        data_config = DataConfig.from_file(args.config)
        overrides = {}
        if args.output:
            overrides["output_dir"] = args.output
        if args.max_documents is not None:
            overrides["max_train_documents"] = args.max_documents
        if args.push:
            overrides["hub_repo"] = args.push
        tokenizer_config = dataclasses.replace(tokenizer_config, **overrides)
        tokenizer, sources = train_run_tokenizer(
            tokenizer_config, data_config, progress=not args.no_progress
        )
        folder = Path(tokenizer_config.output_dir)
        pushed = None
        if tokenizer_config.hub_repo:
            pushed = push_tokenizer_to_hub(folder, tokenizer_config.hub_repo)
    except KitError as error:
        print(f"kit tokenizer train: {error}", file=sys.stderr)
        return 1
    except HfHubHTTPError as error:  # raised by the push: bad token, no write access, ...
        print(
            f"kit tokenizer train: the Hub refused the push ({error}) - help: log in with a "
            "token that may write to the repo (HF_TOKEN or `hf auth login`); the tokenizer is "
            f"saved in {tokenizer_config.output_dir}",
            file=sys.stderr,
        )
        return 1
    summary = {
        "output_dir": str(folder),
        "vocab_size": tokenizer.get_vocab_size(),
        "sources": {source.name: dataclasses.asdict(source.counts()) for source in sources},
        "pushed": pushed,
    }
    print(json.dumps(summary, ensure_ascii=False))
    return 0
