"""Optimizer state per parameter, step time, and training quality: kit's LAMB, its 8-bit LAMB,
and the recipe's reference ``torch_optimizer.Lamb``.

Prints one JSON line. Always: on sahajBERT's ALBERT-large (~18M parameters), per optimizer, bytes
of optimizer state per parameter (every state tensor, shared quantization maps once) and the
median and best step time over ``--steps`` steps with random gradients (the first step, which
allocates the state, is not counted), plus the ratios of lamb8bit to lamb. On the CPU is where
TTT ran its 8-bit LAMB (statistics offloaded); ``--device cuda`` (``auto``: when there is one)
runs the same on a GPU, where bitsandbytes uses its CUDA kernels.

With ``--quality-steps N`` (> 0) it also trains a small ALBERT (vocabulary 8000 x embedding 128,
hidden 256, 2 layers: the embedding table, tied with the MLM decoder, and the attention,
feed-forward and pooler matrices reach the 65,536 elements from which lamb8bit keeps 8-bit
statistics) for N steps on the same
deterministic synthetic MLM + sentence-order batches (32 x 64 tokens) with ``lamb`` and
``lamb8bit`` from the same initial weights and the same dropout masks, with a recipe's LAMB
hyperparameters (``--recipe ttt``: lr 0.0025, betas (0.9, 0.96), eps 1e-6, weight decay 0.045, no
debias, clipping at 4.0 in the step; ``sahajbert``: lr 0.00176, betas (0.9, 0.999), weight decay
0.01, debias, and no clipping, as its local clipping is the trainer's), a linear warmup over the
first tenth of the steps, then a constant rate. It adds under ``"quality"`` each one's first loss
and mean loss over the last 50 steps, their ratio ``lamb8bit_vs_lamb_loss`` (1.0: as good as fp32
LAMB) and the ratio of their state bytes ``lamb8bit_vs_lamb_state_bytes``. ``--ttt-layout`` adds a
third run, ``lamb8bit_ttt_layout``: the 8-bit LAMB with TTT's blocks of 4096 across rows
(``Lamb8bit(row_blocks=False)``, kit's layout before row blocks), and its ratios.

The synthetic corpus is learnable and has rare tokens, as text has: each sequence starts at a
token drawn from a Zipf law over the vocabulary ranks, and each next token is the fixed successor
of the one before it (a random permutation of ranks within bands of 64 ranks, so that frequent
tokens lead to frequent ones and rare ones to rare ones). A masked token is predictable from its
neighbours, and the order of the two halves of a sequence from the direction of the succession.

    python benchmarks/optimizers.py [--steps 5] [--threads 0] [--device auto]
        [--quality-steps 300] [--recipe ttt] [--ttt-layout] [--skip-timing]"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from typing import Any

import torch

from kit.config import RunConfig
from kit.config.model import ModelConfig
from kit.config.training import SAHAJBERT_OPTIMIZER, TTT_OPTIMIZER, OptimizerConfig
from kit.hardware.memory import optimizer_state_bytes
from kit.training.components import (
    build_inner_optimizer,
    build_model,
    build_scheduler,
    parameter_groups,
)

#: The quality task's model: 8000 x 128 embeddings (1.02M elements, tied with the MLM decoder)
#: and 256 x 1024 feed-forward matrices are 8-bit in lamb8bit; 256 x 256 attention is exactly
#: 65,536 elements (8-bit too); the 128 -> 256 projection and the position table stay fp32.
QUALITY_MODEL = ModelConfig(
    vocab_size=8_000,
    embedding_size=128,
    hidden_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=1_024,
    max_position_embeddings=128,
)
QUALITY_BATCH = 32
QUALITY_LENGTH = 64
#: The mean loss over this many last steps is what the two optimizers are compared on.
QUALITY_WINDOW = 50
RECIPES = {"ttt": TTT_OPTIMIZER, "sahajbert": SAHAJBERT_OPTIMIZER}
SPECIAL_TOKENS = 5  # <pad> <unk> [CLS] [SEP] [MASK]: ids 0-4 (kit's tokenizer)
MASK_ID = 4


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    return torch.device(name)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    name: str, model: torch.nn.Module, config: RunConfig, steps: int, device: torch.device
) -> dict[str, Any]:
    model.to(device)
    groups = parameter_groups(model, config.optimizer.weight_decay)
    if name == "torch_optimizer":
        import torch_optimizer

        optimizer: torch.optim.Optimizer = torch_optimizer.Lamb(
            groups, lr=config.optimizer.lr, weight_decay=0.01, clamp_value=10_000.0, debias=True
        )
    else:
        optimizer = build_inner_optimizer(groups, config.optimizer, name=name)
    generator = torch.Generator().manual_seed(0)
    times = []
    parameters = [p for group in groups for p in group["params"]]
    for step in range(steps + 1):
        for param in parameters:
            param.grad = (torch.randn(param.shape, generator=generator) * 1e-3).to(device)
        synchronize(device)
        started = time.perf_counter()
        optimizer.step()
        synchronize(device)
        if step:  # the first step allocates the state
            times.append(time.perf_counter() - started)
    count = sum(p.numel() for p in parameters)
    state = optimizer_state_bytes(optimizer)
    return {
        "parameters": count,
        "state_bytes": state,
        "state_bytes_per_parameter": round(state / count, 3),
        "step_seconds_median": round(statistics.median(times), 4),
        "step_seconds_best": round(min(times), 4),
    }


def timing(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    config = RunConfig.sahajbert()
    results: dict[str, Any] = {"model": "albert-large (sahajBERT)"}
    names = ["lamb", "lamb8bit"]
    try:
        import torch_optimizer  # noqa: F401
    except ImportError:
        pass
    else:
        names.append("torch_optimizer")
    for name in names:
        model = build_model(config)  # a fresh model each: steps change the weights
        results[name] = measure(name, model, config, args.steps, device)
    lamb, eight = results["lamb"], results["lamb8bit"]
    results["lamb8bit_over_lamb"] = {
        "state_bytes": round(eight["state_bytes"] / lamb["state_bytes"], 3),
        "step_time": round(eight["step_seconds_median"] / lamb["step_seconds_median"], 2),
    }
    return results


# --- quality: a short training run on synthetic MLM + SOP batches ------------------------------


def synthetic_batches(
    vocab_size: int,
    steps: int,
    batch: int,
    length: int,
    seed: int = 0,
    follow: float = 1.0,
    exponent: float = 1.0,
) -> list[dict[str, torch.Tensor]]:
    """``steps`` deterministic MLM + sentence-order batches, as ``AlbertForPreTraining`` takes them.

    Each sequence is ``[CLS] A [SEP] B [SEP]`` with two halves of one chain of tokens (see the
    module docstring; with ``follow`` < 1 a token is its predecessor's successor only with that
    probability, else a fresh Zipf draw of exponent ``exponent``); with probability 1/2 the
    halves are swapped (``sentence_order_label`` 1). 15% of the content tokens are predicted
    (``labels``, -100 elsewhere): 80% of those become [MASK], 10% a random token, 10% stay
    (BERT's rule).
    """
    generator = torch.Generator().manual_seed(seed)
    words = vocab_size - SPECIAL_TOKENS
    zipf = torch.arange(1, words + 1, dtype=torch.float64) ** -exponent
    band = 64
    successor = torch.cat(
        [
            start + torch.randperm(min(band, words - start), generator=generator)
            for start in range(0, words, band)
        ]
    )
    half = (length - 3) // 2
    content = 2 * half
    total = steps * batch
    chains = torch.empty(total, content, dtype=torch.long)
    chains[:, 0] = torch.multinomial(zipf, total, replacement=True, generator=generator)
    for position in range(1, content):
        follows = torch.rand(total, generator=generator) < follow
        fresh = torch.multinomial(zipf, total, replacement=True, generator=generator)
        chains[:, position] = torch.where(follows, successor[chains[:, position - 1]], fresh)
    chains += SPECIAL_TOKENS
    first, second = chains[:, :half], chains[:, half:]
    swapped = torch.rand(total, generator=generator) < 0.5
    a = torch.where(swapped[:, None], second, first)
    b = torch.where(swapped[:, None], first, second)
    cls = torch.full((total, 1), 2, dtype=torch.long)
    sep = torch.full((total, 1), 3, dtype=torch.long)
    ids = torch.cat([cls, a, sep, b, sep], dim=1)
    pad = length - ids.shape[1]
    ids = torch.nn.functional.pad(ids, (0, pad), value=0)
    token_type = torch.zeros_like(ids)
    token_type[:, half + 2 : 2 * half + 3] = 1
    attention = (ids != 0).long()
    is_content = ids >= SPECIAL_TOKENS
    predicted = is_content & (torch.rand(ids.shape, generator=generator) < 0.15)
    labels = torch.where(predicted, ids, torch.full_like(ids, -100))
    roll = torch.rand(ids.shape, generator=generator)
    random_tokens = torch.randint(SPECIAL_TOKENS, vocab_size, ids.shape, generator=generator)
    inputs = torch.where(predicted & (roll < 0.8), torch.full_like(ids, MASK_ID), ids)
    inputs = torch.where(predicted & (roll >= 0.8) & (roll < 0.9), random_tokens, inputs)
    return [
        {
            "input_ids": inputs[i : i + batch],
            "attention_mask": attention[i : i + batch],
            "token_type_ids": token_type[i : i + batch],
            "labels": labels[i : i + batch],
            "sentence_order_label": swapped[i : i + batch].long(),
        }
        for i in range(0, total, batch)
    ]


def quality_config(recipe: str, steps: int) -> RunConfig:
    """The quality task: :data:`QUALITY_MODEL` with ``recipe``'s LAMB, warmup over steps / 10."""
    optimizer = OptimizerConfig(
        **{
            **RECIPES[recipe],
            "name": "lamb",
            "warmup_steps": max(1, steps // 10),
            "total_steps": steps,
            "schedule": "constant",
            "clip_grad_norm": None,  # clipping, where the recipe has it, is inside LAMB's step
        }
    )
    base = RunConfig()
    tokenizer = dataclasses.replace(
        base.tokenizer, vocab_size=QUALITY_MODEL.vocab_size, model_max_length=QUALITY_LENGTH
    )
    data = dataclasses.replace(base.data, max_seq_length=QUALITY_LENGTH)
    return dataclasses.replace(
        base, model=QUALITY_MODEL, tokenizer=tokenizer, data=data, optimizer=optimizer
    )


def train_quality(
    name: str,
    config: RunConfig,
    batches: list[dict[str, torch.Tensor]],
    device: torch.device,
    *,
    ttt_layout: bool = False,
) -> dict[str, Any]:
    """Train a fresh (seeded) model with optimizer ``name`` on ``batches``: its losses and state.

    ``ttt_layout``: lamb8bit with TTT's blocks across rows (``row_blocks=False``).
    """
    model = build_model(config).to(device)
    model.train()
    groups = parameter_groups(model, config.optimizer.weight_decay)
    optimizer = build_inner_optimizer(groups, config.optimizer, name=name)
    if ttt_layout:
        optimizer.row_blocks = False  # read when the state is created, at the first step
    scheduler = build_scheduler(optimizer, config.optimizer)
    losses = []
    started = time.perf_counter()
    # The sentence-order head has dropout (classifier_dropout_prob): the same masks in every run.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(1)
        for batch in batches:
            inputs = {key: value.to(device) for key, value in batch.items()}
            optimizer.zero_grad(set_to_none=True)
            loss = model(**inputs).loss
            loss.backward()
            optimizer.step()
            scheduler.step()
            losses.append(loss.detach())
        synchronize(device)
    values = [float(loss) for loss in losses]
    window = values[-QUALITY_WINDOW:]
    return {
        "loss_first": round(values[0], 4),
        "loss_last50_mean": round(sum(window) / len(window), 4),
        "state_bytes": optimizer_state_bytes(optimizer),
        "seconds": round(time.perf_counter() - started, 1),
    }


def quality(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    config = quality_config(args.recipe, args.quality_steps)
    batches = synthetic_batches(
        config.model.vocab_size, args.quality_steps, QUALITY_BATCH, QUALITY_LENGTH, seed=0
    )
    results: dict[str, Any] = {
        "recipe": args.recipe,
        "steps": args.quality_steps,
        "model": {
            "vocab_size": config.model.vocab_size,
            "embedding_size": config.model.embedding_size,
            "hidden_size": config.model.hidden_size,
            "layers": config.model.num_hidden_layers,
            "batch": QUALITY_BATCH,
            "length": QUALITY_LENGTH,
        },
    }
    runs = [("lamb", "lamb", False), ("lamb8bit", "lamb8bit", False)]
    if args.ttt_layout:
        runs.append(("lamb8bit_ttt_layout", "lamb8bit", True))
    for key, name, ttt_layout in runs:
        results[key] = train_quality(name, config, batches, device, ttt_layout=ttt_layout)
    lamb = results["lamb"]
    for key, _, ttt_layout in runs[1:]:
        suffix = "_ttt_layout" if ttt_layout else ""
        eight = results[key]
        results[f"lamb8bit{suffix}_vs_lamb_loss"] = round(
            eight["loss_last50_mean"] / lamb["loss_last50_mean"], 4
        )
        results[f"lamb8bit{suffix}_vs_lamb_state_bytes"] = round(
            eight["state_bytes"] / lamb["state_bytes"], 3
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per optimizer")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where parameters and statistics live; auto: cuda when available",
    )
    parser.add_argument(
        "--quality-steps",
        type=int,
        default=0,
        help="also train a small ALBERT this many steps with lamb and lamb8bit (e.g. 300); 0: off",
    )
    parser.add_argument(
        "--recipe", choices=sorted(RECIPES), default="ttt", help="LAMB settings of the quality run"
    )
    parser.add_argument(
        "--ttt-layout",
        action="store_true",
        help="also train lamb8bit with TTT's blocks of 4096 across rows (the layout before rows)",
    )
    parser.add_argument(
        "--skip-timing", action="store_true", help="only the quality run (with --quality-steps)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    results: dict[str, Any] = {"device": str(device), "threads": torch.get_num_threads()}
    if not args.skip_timing:
        results.update(timing(args, device))
    if args.quality_steps > 0:
        if args.quality_steps < QUALITY_WINDOW:
            raise SystemExit(f"--quality-steps: use at least {QUALITY_WINDOW} (the loss window)")
        results["quality"] = quality(args, device)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
