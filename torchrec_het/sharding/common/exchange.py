"""All-to-all exchanges of variable-size segments, the plugin's point-to-point traffic, and the input
dists' first collective (:class:`GatheredCounts`: every rank's send counts and batch size).

Every rank calls each function in the same order with its own segments. :class:`Transfer` is the
one transport: an all-to-all in flight, its payload under a quantized-comms codec or as it is; both
types' float payloads travel by it. :func:`exchange_counts`
and :func:`exchange_flat` block; :func:`start_exchange` starts one that autograd can
differentiate and returns an :class:`Exchange` whose ``wait()`` returns what arrived, by
source. In the backward the gradient travels the reverse way: the receiving side's backward
starts the reverse all-to-all and the sending side's backward waits for it, so other backward
work can run in between (TorchRec's request/wait pattern in ``comm_ops``). When no rank sends
to another (``local_only``), nothing is sent at all: each rank's own segment is its input.
"""

import functools
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function
from torchrec.distributed.types import Awaitable

from torchrec_het.sharding.common.wire_codec import WireCodecs

_AS_IS = WireCodecs()


class Transfer(Awaitable[torch.Tensor]):
    """One all-to-all of a flat tensor in flight, the plugin's one transport (``send_splits[d]``
    elements to rank d, ``recv_splits[s]`` from rank s); waited: what arrived, by source, decoded.

    ``codec``: a :class:`~torchrec_het.sharding.common.wire_codec.WireCodec` (whole segments coded)
    or a :class:`~torchrec_het.sharding.het_cache.coded_rows.ValueCodec` (the values of a mixed payload);
    None or inactive: sent as it is. ``sides``: what the codec reads of each side, (sent, received);
    by default the splits. ``local_only``: no rank sends to another; this rank's own segment is
    what arrives, and nothing is sent."""

    def __init__(
        self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], pg, codec=None,
        sides: tuple | None = None, local_only: bool = False, rank: int = 0,
    ):  # fmt: skip
        super().__init__()
        self.codec = codec if codec is not None and codec.active else None
        out, self.into = sides if sides is not None else (send_splits, recv_splits)
        self.ctx, self.work = None, None
        if self.codec is not None:
            self.ctx = self.codec.context()
            send = self.codec.encode(send, out, self.ctx)
            send_splits, recv_splits = (
                self.codec.wire_splits(out, self.ctx),
                self.codec.wire_splits(self.into, self.ctx),
            )
        if local_only:
            start = sum(send_splits[:rank])
            self.received = send[start : start + send_splits[rank]].clone()
            self.into = self.into[rank : rank + 1]
        else:
            self.received = send.new_empty(sum(recv_splits))
            self.work = dist.all_to_all_single(
                self.received, send.contiguous(), recv_splits, send_splits, group=pg, async_op=True
            )

    def _wait_impl(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        received, self.received, self.work = self.received, None, None
        return received if self.codec is None else self.codec.decode(received, self.into, self.ctx)


class Exchange:
    """One started exchange (forward), and the state its backward needs. ``codecs``
    (:class:`~torchrec_het.sharding.common.wire_codec.WireCodecs`): a float payload's quantized-comms
    codecs, forward for what is sent, backward for its gradient; None: sent as it is (ids)."""

    def __init__(
        self, send_splits: list[int], recv_splits: list[int], pg, local_only: bool, rank: int,
        codecs: WireCodecs | None = None, grad_scale: float = 1.0,
    ):  # fmt: skip
        self.send_splits, self.recv_splits, self.pg = send_splits, recv_splits, pg
        self.grad_scale = grad_scale
        self.local_only, self.rank = local_only, rank
        self.codecs = codecs if codecs is not None else _AS_IS
        self.transfer: Transfer | None = None
        self.received: torch.Tensor | None = None  # what a forward sent elsewhere came to (:meth:`arrive`)
        self.grad_transfer: Transfer | None = None
        self.dummy: torch.Tensor | None = None
        self.send_dtype, self.send_shape = torch.float32, torch.Size()
        self.deferred_backward = None  # the send's own backward, run once its gradient has arrived
        self.owed: list | None = None  # where a backward on the main thread leaves it for its owner
        self.forward_elsewhere = False  # the forward's payload travels by other exchanges (:meth:`arrive`)

    def arrive(self, received: torch.Tensor) -> None:
        """What the forward's payload came to by other exchanges (decoded, flat, by source): ``wait()``
        returns it; the backward runs as for a payload this exchange sent."""
        self.received = received

    def start_gradient(self, grad: torch.Tensor) -> None:
        """Sends the received tensor's gradient back the reverse way (its backward's exchange). Under a
        backward codec the gradient travels unscaled and ``grad_scale`` (TorchRec's gradient division,
        applied by the output dist) is applied on arrival, as TorchRec's all-to-all does: small
        gradients would otherwise lose more to the codec."""
        grad = grad.reshape(-1)
        if self.codecs.backward.active and self.grad_scale != 1.0:
            grad = grad / self.grad_scale
        self.grad_transfer = self._transfer(grad, self.recv_splits, self.send_splits, self.codecs.backward)

    def _transfer(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], codec) -> Transfer:
        return Transfer(send, send_splits, recv_splits, self.pg, codec, local_only=self.local_only, rank=self.rank)

    def wait(self) -> torch.Tensor:
        """What arrived (call once). The link to the forward send is handed to autograd here and
        dropped: kept, ``dummy`` -> its ``_Send`` node -> ``ctx.exchange`` -> ``dummy`` would be a
        cycle through an autograd node, which Python's gc cannot free (every step's graph leaked)."""
        dummy, self.dummy = self.dummy, None
        if dummy is None:
            raise RuntimeError("Exchange.wait() called twice")
        return _Receive.apply(self, dummy)

    def gradient(self) -> torch.Tensor:
        """The gradient of what was sent (waits for it; once, after the backward started its exchange)."""
        transfer, self.grad_transfer = self.grad_transfer, None
        grad = transfer.wait()
        if self.codecs.backward.active and self.grad_scale != 1.0:
            grad = grad * self.grad_scale
        return grad.to(self.send_dtype).view(self.send_shape)

    def hand_over(self) -> None:
        """End of the backward pass: the sent tensor's own backward runs with its gradient, once arrived."""
        backward, self.deferred_backward = self.deferred_backward, None
        with record_function("## het owners' backward ##"):
            backward(self.gradient())


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx, exchange: Exchange, send: torch.Tensor):
        ctx.exchange = exchange
        exchange.send_dtype, exchange.send_shape = send.dtype, send.shape
        if not exchange.forward_elsewhere:
            exchange.transfer = exchange._transfer(
                send.detach().reshape(-1), exchange.send_splits, exchange.recv_splits, exchange.codecs.forward
            )
        return torch.empty(0, device=send.device, dtype=send.dtype)

    @staticmethod
    def backward(ctx, _):
        exchange = ctx.exchange
        if exchange.deferred_backward is not None:  # handed over at the end of the backward pass
            return None, None
        return None, exchange.gradient()


class _Receive(torch.autograd.Function):
    @staticmethod
    def forward(ctx, exchange: Exchange, dummy: torch.Tensor):
        ctx.exchange = exchange
        # The exchange lets go of what arrived: ``.to`` of the same dtype is that tensor itself,
        # which autograd makes this node's output; kept on the exchange, output -> node ->
        # ctx.exchange -> output would be a cycle gc cannot free.
        if exchange.forward_elsewhere:
            received, exchange.received = exchange.received, None
            if received is None:
                raise RuntimeError("an exchange whose forward travels elsewhere was waited before it arrived")
            return received.to(dummy.dtype)
        transfer, exchange.transfer = exchange.transfer, None
        return transfer.wait().to(dummy.dtype)

    @staticmethod
    def backward(ctx, grad):
        exchange = ctx.exchange
        if exchange.deferred_backward is None:  # the sender's backward waits for it in this pass
            exchange.start_gradient(grad)
        elif threading.current_thread() is threading.main_thread():
            # its owner hands it over when it next needs its rows; it leaves after the pass's other
            # traffic (DDP's all-reduce), which the pass waits for
            after_backward_pass(functools.partial(exchange.start_gradient, grad))
            exchange.owed.append(exchange)
        else:  # a backward on a worker thread: sent and handed over at the end of its pass, on that thread
            after_backward_pass(functools.partial(_send_and_hand_over, exchange, grad))
        return None, torch.empty(0, device=grad.device, dtype=grad.dtype)


def _send_and_hand_over(exchange: Exchange, grad: torch.Tensor) -> None:
    exchange.start_gradient(grad)
    exchange.hand_over()


def after_backward_pass(fn) -> None:
    """Runs ``fn`` at the end of the current backward pass, after every end-of-pass callback queued
    during it (DDP's, which waits for its gradient all-reduce); outside a backward pass, now.

    Traffic that the pass does not wait for (the owners' deferred gradients, replica syncs) then
    starts once DDP's all-reduce is done: sharing the link, it would delay the pass's end instead.
    Design: docs/internals.md#exchange"""
    if torch._C._current_autograd_node() is None:
        fn()
        return
    engine = torch.autograd.Variable._execution_engine
    engine.queue_callback(lambda: engine.queue_callback(fn))  # queued from a callback: after those queued before


def start_exchange(
    send: torch.Tensor, send_splits: list[int], recv_splits: list[int], pg, local_only: bool,
    codecs: WireCodecs | None = None, defer_backward: list | None = None, on_gradient=None,
    grad_scale: float = 1.0, forward_elsewhere: bool = False,
) -> Exchange:  # fmt: skip
    """Starts sending ``send`` (flattened: segments by destination); ``wait()`` returns a flat
    tensor and is differentiable. ``codecs``: a float payload's quantized-comms codecs (forward:
    ``send``; backward: its gradient); None: sent as it is. ``grad_scale``: the factor the receiver
    applied to the gradient (TorchRec's gradient division), moved past the backward codec.

    ``defer_backward``: ``send``'s own backward runs later, with its gradient once arrived: a
    backward pass on the main thread appends the exchange to this list, for the owner to call
    :meth:`Exchange.hand_over` when it next needs what that backward updates; one on a worker
    thread runs it at the end of its pass. ``on_gradient``: with ``defer_backward``, what that
    backward is (called with the gradient) for a ``send`` computed outside autograd.
    ``forward_elsewhere``: nothing is sent now; the payload arrives by other exchanges
    (:meth:`Exchange.arrive`, before ``wait()``), and the backward is this exchange's as usual."""
    exchange = Exchange(send_splits, recv_splits, pg, local_only, dist.get_rank(pg), codecs, grad_scale)
    exchange.forward_elsewhere = forward_elsewhere
    if defer_backward is not None and (on_gradient is not None or send.requires_grad):
        graph = send if send.requires_grad else None
        send = send.detach().requires_grad_()
        exchange.deferred_backward = functools.partial(_backward_of_send, graph, on_gradient)
        exchange.owed = defer_backward
    exchange.dummy = _Send.apply(exchange, send)
    return exchange


def _backward_of_send(graph: torch.Tensor | None, on_gradient, grad: torch.Tensor) -> None:
    """A deferred send's backward: autograd's through what it was computed from (``graph``), and
    ``on_gradient`` for what was computed outside autograd."""
    if graph is not None:
        torch.autograd.backward(graph, grad)
    if on_gradient is not None:
        on_gradient(grad)


def exchange_counts(counts: torch.Tensor, pg: dist.ProcessGroup | None) -> torch.Tensor:
    """Row d of ``counts`` goes to rank d; returns the rows every rank sent to this one.

    Args:
        counts: int64 ``[world_size, k]``.
        pg: the process group.
    """
    world_size, k = counts.shape
    received = torch.empty_like(counts)
    dist.all_to_all_single(
        received.view(-1), counts.contiguous().view(-1), [k] * world_size, [k] * world_size, group=pg
    )
    return received


def exchange_flat(
    send: torch.Tensor, send_splits: list[int], recv_splits: list[int], pg: dist.ProcessGroup | None
) -> torch.Tensor:
    """Sends ``send[sum(send_splits[:d]) : ...]`` to rank d; returns what arrives, by source rank.

    Args:
        send: a 1-D tensor, its segments ordered by destination rank.
        send_splits: elements for each destination.
        recv_splits: elements from each source.
        pg: the process group.
    """
    received = send.new_empty(sum(recv_splits))
    dist.all_to_all_single(received, send.contiguous(), recv_splits, send_splits, group=pg)
    return received


@dataclass
class Splits:
    """Every rank's counts, once gathered: ``table[s][d]`` items rank s sends to rank d, then its batch size."""

    table: list[list[int]]
    rank: int

    @property
    def send(self) -> list[int]:
        return self.table[self.rank][: len(self.table)]

    @property
    def recv(self) -> list[int]:
        return [row[self.rank] for row in self.table]

    @property
    def batch_sizes(self) -> set[int]:
        return {row[-1] for row in self.table}

    def crosses_ranks(self) -> bool:
        """Whether any rank sends to another."""
        return any(c for s, row in enumerate(self.table) for d, c in enumerate(row[:-1]) if s != d)


class GatheredCounts:
    """The input dist's one all-gather in flight: every rank's items per destination and batch size.

    Args:
        dest: the destination rank of each item this rank sends.
        batch: this rank's batch size.
        pg: the process group.
    """

    def __init__(self, dest: torch.Tensor, batch: int, pg) -> None:
        world_size = dist.get_world_size(pg)
        counts = torch.cat([torch.bincount(dest, minlength=world_size), torch.tensor([batch], device=dest.device)])
        self.gathered = [torch.empty_like(counts) for _ in range(world_size)]
        self.rank = dist.get_rank(pg)
        self.work = dist.all_gather(self.gathered, counts, group=pg, async_op=True)

    def wait(self) -> Splits:
        """The counts of every rank (the input dist's host sync)."""
        self.work.wait()
        return Splits(torch.stack(self.gathered).tolist(), self.rank)
