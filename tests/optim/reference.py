"""The model, data shards and single-process reference training shared by the optimizer tests."""

from __future__ import annotations

import torch

SHARD_BATCHES = {0: (8, 8), 1: (16,), 2: (4, 4, 4)}  # micro-batch sizes of each peer, per epoch


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def micro_batches(peer: int, epoch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Peer ``peer``'s deterministic data for ``epoch``."""
    generator = torch.Generator().manual_seed(1000 * epoch + peer)
    batches = []
    for size in SHARD_BATCHES[peer]:
        inputs = torch.randn(size, 8, generator=generator)
        batches.append((inputs, inputs[:, :2] * 2 - inputs[:, 2:4]))
    return batches


def target_batch_size(peers: int) -> int:
    return sum(sum(SHARD_BATCHES[p]) for p in range(peers))


def train_reference(peers: int, epochs: int) -> torch.Tensor:
    """One process, the same global batch by gradient accumulation: what peers must match."""
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    total = target_batch_size(peers)
    for epoch in range(epochs):
        opt.zero_grad()
        for peer in range(peers):
            for inputs, targets in micro_batches(peer, epoch):
                loss = torch.nn.functional.mse_loss(model(inputs), targets) * len(inputs) / total
                loss.backward()
        opt.step()
        scheduler.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
