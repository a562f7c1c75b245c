"""The differentiable all-to-all of the plugin's dists frees each step's graph once it is done."""

import gc
import weakref

import pytest
import torch
import torch.distributed as dist

from torchrec_het.sharding.common.exchange import start_exchange


@pytest.mark.parametrize("local_only", [False, True])
def test_a_finished_exchange_and_its_graph_are_freed(one_rank_env, local_only: bool) -> None:  # noqa: ARG001
    send = torch.arange(6.0).requires_grad_()
    exchange = start_exchange(send * 2, [6], [6], dist.group.WORLD, torch.float32, local_only)
    received = exchange.wait()
    assert torch.equal(received, torch.arange(6.0) * 2)
    (received * torch.arange(6.0)).sum().backward()
    assert torch.equal(send.grad, torch.arange(6.0) * 2)  # the gradient came back the reverse way
    with pytest.raises(RuntimeError, match="twice"):
        exchange.wait()
    freed = weakref.ref(exchange)
    del exchange, received
    gc.collect()
    assert freed() is None  # no cycle through its autograd nodes keeps it (and every step's graph) alive


@pytest.mark.parametrize("local_only", [False, True])
def test_a_deferred_backward_runs_at_the_end_of_the_pass_and_is_freed(one_rank_env, local_only: bool) -> None:  # noqa: ARG001
    """With ``defer_backward`` the sender's producer steps after every other node of the backward
    pass (the gradients fly under it), with the same gradient; an exchange whose backward never
    runs leaves nothing behind."""
    order: list[str] = []
    other = torch.ones(3, requires_grad=True)
    early = other * 3  # created before the exchange: without deferral the engine runs it after the producer
    early.register_hook(lambda grad: order.append("other"))
    send = torch.arange(6.0).requires_grad_()
    produced = send * 2
    produced.register_hook(lambda grad: order.append("producer"))
    exchange = start_exchange(produced, [6], [6], dist.group.WORLD, torch.float32, local_only, defer_backward=True)
    received = exchange.wait()
    ((received * torch.arange(6.0)).sum() + early.sum()).backward()
    assert order == ["other", "producer"]
    assert torch.equal(send.grad, torch.arange(6.0) * 2)
    freed = weakref.ref(exchange)
    del exchange, received
    gc.collect()
    assert freed() is None

    unused = start_exchange(send * 2, [6], [6], dist.group.WORLD, torch.float32, local_only, defer_backward=True)
    unused.wait()
    freed = weakref.ref(unused)
    del unused
    gc.collect()
    assert freed() is None
