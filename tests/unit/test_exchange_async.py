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
