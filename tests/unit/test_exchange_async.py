"""The differentiable all-to-all of the plugin's dists frees each step's graph once it is done."""

import gc
import threading
import time
import weakref

import pytest
import torch
import torch.distributed as dist

from torchrec_het.sharding.common.exchange import start_exchange


@pytest.mark.parametrize("local_only", [False, True])
def test_a_finished_exchange_and_its_graph_are_freed(one_rank_env, local_only: bool) -> None:  # noqa: ARG001
    send = torch.arange(6.0).requires_grad_()
    exchange = start_exchange(send * 2, [6], [6], dist.group.WORLD, local_only)
    received = exchange.wait()
    assert torch.equal(received, torch.arange(6.0) * 2)
    (received * torch.arange(6.0)).sum().backward()
    assert torch.equal(send.grad, torch.arange(6.0) * 2)  # the gradient came back the reverse way
    with pytest.raises(RuntimeError, match="twice"):
        exchange.wait()
    freed = weakref.ref(exchange)
    del exchange, received
    assert _freed(freed)  # no cycle through its autograd nodes keeps it (and every step's graph) alive


def _freed(ref: weakref.ref, within_s: float = 5.0) -> bool:
    """Whether ``ref``'s object is freed within ``within_s``. Gloo's worker thread still holds a finished
    all-to-all's output for a moment after ``wait()`` returns (and through its autograd meta, the
    exchange); a leak holds it for good."""
    deadline = time.monotonic() + within_s
    while True:
        gc.collect()
        if ref() is None:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)


def _deferred_case(local_only: bool, owed: list):
    """An exchange with a deferred backward beside a node the engine runs after its producer
    when nothing is deferred (created earlier); the hooks record the order they run in."""
    order: list[str] = []
    other = torch.ones(3, requires_grad=True)
    early = other * 3
    early.register_hook(lambda grad: order.append("other"))
    send = torch.arange(6.0).requires_grad_()
    produced = send * 2
    produced.register_hook(lambda grad: order.append("producer"))
    exchange = start_exchange(produced, [6], [6], dist.group.WORLD, local_only, defer_backward=owed)
    received = exchange.wait()
    loss = (received * torch.arange(6.0)).sum() + early.sum()
    return order, send, exchange, loss


@pytest.mark.parametrize("local_only", [False, True])
def test_a_deferred_backward_waits_for_its_owner_and_is_freed(one_rank_env, local_only: bool) -> None:  # noqa: ARG001
    """With ``defer_backward`` the producer of what was sent does not step in the backward pass:
    the exchange is owed, and its owner's ``hand_over`` runs it with the right gradient; an
    exchange whose backward never runs leaves nothing behind."""
    owed: list = []
    order, send, exchange, loss = _deferred_case(local_only, owed)
    loss.backward()
    assert order == ["other"] and owed == [exchange] and send.grad is None
    owed.pop().hand_over()
    assert order == ["other", "producer"]
    assert torch.equal(send.grad, torch.arange(6.0) * 2)
    freed = weakref.ref(exchange)
    del exchange, loss
    assert _freed(freed)

    unused = start_exchange(send * 2, [6], [6], dist.group.WORLD, local_only, defer_backward=owed)
    unused.wait()
    freed = weakref.ref(unused)
    del unused
    assert _freed(freed) and owed == []


def test_a_deferred_backward_on_a_worker_thread_ends_its_pass(one_rank_env) -> None:  # noqa: ARG001
    """A backward on a worker thread (the hybrid pipeline's) runs the producer at the end of its own pass."""
    owed: list = []
    order, send, _, loss = _deferred_case(False, owed)
    worker = threading.Thread(target=loss.backward)
    worker.start()
    worker.join()
    assert order == ["other", "producer"] and owed == []
    assert torch.equal(send.grad, torch.arange(6.0) * 2)
