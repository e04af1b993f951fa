"""A step that leaves a parameter inf/NaN is rolled back, counted, and never shared."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

import kit

pytestmark = [pytest.mark.sockets]


class ExplodingSGD(torch.optim.SGD):
    """SGD whose steps number ``explode_at`` write NaN into the first parameter."""

    def __init__(self, params: Any, explode_at: set[int]) -> None:
        super().__init__(params, lr=0.1)
        self.explode_at = explode_at
        self.calls = 0

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        self.calls += 1
        super().step(closure)
        if self.calls in self.explode_at:
            self.param_groups[0]["params"][0].fill_(float("nan"))


@pytest.fixture
def dht():
    node = kit.DHT(host="127.0.0.1", client_mode=False)
    yield node
    node.shutdown()


def one_step(opt: kit.Optimizer, model: torch.nn.Module, batch: int = 4) -> None:
    generator = torch.Generator().manual_seed(opt.local_epoch)
    inputs = torch.randn(batch, 3, generator=generator)
    model(inputs).pow(2).mean().backward()
    opt.step(batch_size=batch)
    opt.zero_grad()


@pytest.mark.parametrize("local_updates", [False, True], ids=["global-step", "local-updates"])
def test_a_non_finite_step_is_rolled_back_and_never_shared(dht, local_updates: bool) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = kit.Optimizer(
        dht=dht,
        run_id=f"nonfinite-{local_updates}",
        target_batch_size=4,
        optimizer=lambda params: ExplodingSGD(params, explode_at={2}),
        params=model.parameters(),
        use_local_updates=local_updates,
        matchmaking_time=0.1,  # a lone peer: each global step waits for nobody ~1.2 s
        averaging_timeout=5.0,
        tracker_opts={"min_refresh_period": 0.1, "max_refresh_period": 0.5},
    )
    try:
        one_step(opt, model)
        assert opt.nonfinite_rollbacks == 0
        good = [p.detach().clone() for p in model.parameters()]
        one_step(opt, model)  # the inner step writes NaN
        assert opt.nonfinite_rollbacks == 1
        assert all(torch.isfinite(p).all() for p in model.parameters())
        assert all(torch.equal(p, g) for p, g in zip(model.parameters(), good, strict=True))
        # What late joiners download and averaging reads: finite. It is published on the
        # runtime loop, which may not have run since the step (the GIL): wait for it, bounded.
        give_up = time.monotonic() + 10.0
        while (
            opt._driver.sharing.server.snapshot is not opt._driver.sharing.last_shared
            and time.monotonic() < give_up
        ):
            time.sleep(0.01)
        snapshot = opt._driver.sharing.server.snapshot
        assert snapshot is not None and snapshot is opt._driver.sharing.last_shared
        assert all(torch.isfinite(t).all() for t in snapshot.tensors if t.is_floating_point())
        one_step(opt, model)  # training goes on
        assert opt.nonfinite_rollbacks == 1
        assert all(torch.isfinite(p).all() for p in model.parameters())
    finally:
        opt.shutdown()
