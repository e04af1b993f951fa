"""Where the inner optimizer steps: in place, on float32 CPU copies, in a background thread."""

from __future__ import annotations

import threading

import pytest
import torch

from kit.optim.stepping import InnerOptimizer


def sgd(params: object) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1.0)  # type: ignore[arg-type]


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def ones(inner: InnerOptimizer) -> list[torch.Tensor]:
    return [torch.ones_like(p, dtype=torch.float32) for p in inner.params]


def test_in_place_the_optimizer_steps_on_the_model_parameters() -> None:
    net = model()
    inner = InnerOptimizer(sgd(net.parameters()), None, copies=False, delay=False)
    assert not inner.has_copies and inner.master[0] is inner.params[0]
    before = [p.detach().clone() for p in net.parameters()]
    inner.set_gradients(ones(inner), reuse_grad_buffers=False)
    inner.step(True, None, reuse_grad_buffers=False)
    assert not inner.pending and inner.finish(wait=0.0) is False
    for old, new in zip(before, net.parameters(), strict=True):
        torch.testing.assert_close(new.detach(), old - 1.0)
        assert new.grad is None  # the next backward must not add to the average


def test_copies_are_float32_cpu_and_the_model_takes_their_step() -> None:
    net = model().to(torch.float64)
    inner = InnerOptimizer(sgd, net.parameters(), copies=True, delay=False)
    assert inner.has_copies and all(m.dtype == torch.float32 for m in inner.master)
    before = [p.detach().clone() for p in net.parameters()]
    inner.set_gradients(ones(inner), reuse_grad_buffers=False)
    inner.step(True, None, reuse_grad_buffers=False)
    for old, new, master in zip(before, net.parameters(), inner.master, strict=True):
        assert new.dtype == torch.float64
        torch.testing.assert_close(new.detach(), old - 1.0)
        torch.testing.assert_close(master.double(), new.detach())


def test_a_delayed_step_runs_in_its_thread_and_lands_at_finish() -> None:
    net = model()
    inner = InnerOptimizer(sgd, net.parameters(), copies=False, delay=True)
    gate = threading.Event()
    order: list[str] = []

    class Scheduler:
        def step(self) -> None:
            order.append("scheduler")

    def before() -> bool:
        gate.wait(5.0)
        order.append(threading.current_thread().name)
        inner.set_gradients(ones(inner), reuse_grad_buffers=False)
        return True  # (False: the averaged gradient was not finite, skip the step)

    try:
        old = [p.detach().clone() for p in net.parameters()]
        inner.step(True, Scheduler(), reuse_grad_buffers=False, before=before)
        assert inner.pending and inner.finish(wait=0.0) is False  # still running
        for was, now in zip(old, net.parameters(), strict=True):
            assert torch.equal(was, now.detach())  # the model keeps its parameters meanwhile
        gate.set()
        assert inner.finish(wait=5.0) is True and not inner.pending
        assert order[0].startswith("kit-optimizer-step") and order[1] == "scheduler"
        for was, now in zip(old, net.parameters(), strict=True):
            torch.testing.assert_close(now.detach(), was - 1.0)
    finally:
        inner.shutdown()


def test_a_failing_delayed_step_raises_at_finish() -> None:
    net = model()
    inner = InnerOptimizer(sgd, net.parameters(), copies=False, delay=True)

    def broken() -> None:
        raise RuntimeError("boom")

    inner.step(False, None, reuse_grad_buffers=False, before=broken)
    with pytest.raises(RuntimeError, match="boom"):
        inner.finish(wait=5.0)
    assert not inner.pending
    inner.shutdown()


def test_load_and_add_move_the_model_and_its_copies() -> None:
    net = model()
    inner = InnerOptimizer(sgd, net.parameters(), copies=True, delay=False)
    inner.load([torch.full_like(p, 2.0) for p in inner.params])
    inner.add([torch.full_like(p, 0.5) for p in inner.params])
    for param, master in zip(inner.params, inner.master, strict=True):
        assert torch.all(param == 2.5) and torch.all(master == 2.5)


def test_reused_grad_buffers_are_zeroed_not_dropped() -> None:
    net = model()
    inner = InnerOptimizer(sgd, net.parameters(), copies=True, delay=False)
    for param in net.parameters():
        param.grad = torch.ones_like(param)
    inner.set_gradients(ones(inner), reuse_grad_buffers=True)
    assert all(p.grad is not None and not p.grad.any() for p in net.parameters())
    inner.step(True, None, reuse_grad_buffers=True)
    assert all(m.grad is not None and not m.grad.any() for m in inner.master)


def test_parameter_groups_keep_their_options() -> None:
    net = model()
    groups = [{"params": [net.weight], "lr": 0.1}, {"params": [net.bias]}]
    inner = InnerOptimizer(sgd, groups, copies=True, delay=False)
    assert [g["lr"] for g in inner.opt.param_groups] == [0.1, 1.0]
    assert inner.params == [net.weight, net.bias]
