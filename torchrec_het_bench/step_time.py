"""Where a training step's time goes: embedding forward, embedding backward, dense, waiting on communication.

A :class:`StepClock` splits the wall time of one step on the thread that runs it into
exclusive parts. Timed regions nest; at every instant the innermost open region owns the
time, and time in no region is ``dense``. So each instant counts once, the parts add up to
``total`` exactly, and nothing is double counted when regions nest (a wait inside the
embedding forward is ``comm_wait``, not also ``emb_fwd``). Collectives that progress on
gloo's own threads while the step's thread computes (the overlap a pipeline buys) cost the
step nothing and appear nowhere; only the time the step's thread is blocked on them does.

The parts, in seconds per step (``step_ms`` in results.json is their median in ms):

- ``comm_wait``: blocked on a collective: inside ``Work.wait()`` of a ``torch.distributed``
  work handle, which covers waits on asynchronous collectives (TorchRec's input and output
  dists, their gradients in backward, the plugin's exchanges) and synchronous ones
  (``torch.distributed`` waits on the handle before returning). Not in it: DDP's wait for
  the dense all-reduce, which DDP's C++ reducer does at the end of backward (that is in
  ``dense``).
- ``emb_fwd``: the sharded embedding modules' forward work: their ``input_dist`` and
  ``compute_and_output_dist`` calls (input dist issue, lookup, output dist issue) and every
  TorchRec ``Awaitable.wait()`` (finishing the input dist, assembling the output when the
  dense part first reads it), less the ``comm_wait`` inside. Under ``sparse_dist`` it
  includes the next batch's input dist, which the pipeline runs during this step.
- ``emb_bwd``: executing the autograd nodes of the embedding modules' backward: every node
  reachable from a sharded module's output (output dist backward, the lookup's backward
  with the fused optimizer update, the plugin's exchanges and replica syncs there) and the
  plugin's owner backward deferred to the end of the pass (``Exchange.hand_over``), less
  the ``comm_wait`` inside.
- ``dense``: ``total`` minus the three above: the dense forward, loss and backward, DDP's
  all-reduce wait, the optimizer step, ``zero_grad``, the pipeline's bookkeeping, and any
  embedding-side work outside the regions above.
- ``total``: the step's wall time on this rank.

The clock is cheap (a ``perf_counter`` per region edge, a few dozen per step). It needs no
change to the code it measures: :func:`instrument` wraps methods of the sharded module
instances (TorchRec's ``ShardedModule``, the plugin's included) and :func:`timing_installed`
patches ``Work.wait`` and TorchRec's ``Awaitable.wait`` for the duration of a run. Under a
TorchRec pipeline, which swaps a sharded module's ``forward`` but calls its ``input_dist``
and ``compute_and_output_dist``, the same wrappers fire.
"""

import functools
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

TIMED_PARTS = ("emb_fwd", "emb_bwd", "comm_wait")
STEP_PARTS = ("emb_fwd", "emb_bwd", "dense", "comm_wait", "total")


class StepClock:
    """Exclusive time per part between :meth:`start` and :meth:`stop`, on the thread that started it."""

    def __init__(self) -> None:
        self._stack: list[str] = []
        self._spent = dict.fromkeys(TIMED_PARTS, 0.0)
        self._mark = self._begin = 0.0
        self._thread: int | None = None
        self._hooks: list = []  # this step's autograd hook handles, removed at stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and threading.get_ident() == self._thread

    def start(self) -> None:
        self._stack.clear()
        self._spent = dict.fromkeys(TIMED_PARTS, 0.0)
        self._thread = threading.get_ident()
        self._begin = self._mark = time.perf_counter()

    def stop(self) -> dict[str, float]:
        """Seconds per part of :data:`STEP_PARTS` since :meth:`start`."""
        now = time.perf_counter()
        if self._stack:  # a region left open (an exception went through it): close it now
            self._spent[self._stack[-1]] += now - self._mark
            self._stack.clear()
        self._thread = None
        for handle in self._hooks:  # nodes that outlive the step (DDP keeps its parameters'
            handle.remove()  # gradient accumulators) must not gather hooks step after step
        self._hooks.clear()
        total = now - self._begin
        parts = dict(self._spent, total=total)
        parts["dense"] = max(0.0, total - sum(self._spent.values()))
        return parts

    def hold(self, handle) -> None:
        """Removes the hook behind ``handle`` when the step stops."""
        self._hooks.append(handle)

    def enter(self, part: str) -> None:
        now = time.perf_counter()
        if self._stack:
            self._spent[self._stack[-1]] += now - self._mark
        self._stack.append(part)
        self._mark = now

    def leave(self) -> None:
        if not self._stack:  # unbalanced (the step started inside a region): nothing to close
            return
        now = time.perf_counter()
        self._spent[self._stack.pop()] += now - self._mark
        self._mark = now

    @contextmanager
    def region(self, part: str) -> Iterator[None]:
        if not self.running:
            yield
            return
        self.enter(part)
        try:
            yield
        finally:
            self.leave()


CLOCK = StepClock()  # one step runs at a time in a rank: one clock serves every configuration


def _embedding_part() -> str:
    """Embedding work done inside an autograd node is backward work."""
    return "emb_bwd" if torch._C._current_autograd_node() is not None else "emb_fwd"


def _timed(method, part_of):
    @functools.wraps(method)
    def timed(*args, **kwargs):
        if not CLOCK.running:
            return method(*args, **kwargs)
        with CLOCK.region(part_of()):
            return method(*args, **kwargs)

    return timed


def _tensors(value: object) -> list[torch.Tensor]:
    """The gradient-carrying tensors of an embedding module's output (KeyedTensor, JaggedTensor dicts, tensors)."""
    if isinstance(value, torch.Tensor):
        return [value] if value.grad_fn is not None else []
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    values = getattr(value, "values", None)  # KeyedTensor, JaggedTensor
    if callable(values):
        return _tensors(values())
    return []


def _time_backward_of(output: object) -> object:
    """Times, as ``emb_bwd``, every autograd node reachable from ``output`` (an awaitable callback)."""
    if not CLOCK.running or not torch.is_grad_enabled():
        return output
    seen: set[int] = set()
    todo = [t.grad_fn for t in _tensors(output)]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        CLOCK.hold(node.register_prehook(_node_starts))
        CLOCK.hold(node.register_hook(_node_ends))
        todo.extend(next_node for next_node, _ in node.next_functions)
    return output


def _node_starts(grad_outputs):
    if CLOCK.running:
        CLOCK.enter("emb_bwd")


def _node_ends(grad_inputs, grad_outputs):
    if CLOCK.running:
        CLOCK.leave()


def _compute_and_output_dist(method):
    timed = _timed(method, lambda: "emb_fwd")

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        awaitable = timed(*args, **kwargs)
        if CLOCK.running and hasattr(awaitable, "callbacks"):
            awaitable.callbacks.append(_time_backward_of)  # runs on the module's final output
        return awaitable

    return wrapper


def instrument(model: nn.Module) -> int:
    """Wraps the sharded embedding modules of ``model`` for the clock (once per module); returns how many."""
    from torchrec.distributed.types import ShardedModule

    count = 0
    for module in model.modules():
        if not isinstance(module, ShardedModule):
            continue
        count += 1
        if getattr(module, "_bench_step_timed", False):
            continue
        # Instance attributes: TorchRec's forward and its pipelines' PipelinedForward call these.
        module.input_dist = _timed(module.input_dist, _embedding_part)
        module.compute_and_output_dist = _compute_and_output_dist(module.compute_and_output_dist)
        module._bench_step_timed = True
    return count


@contextmanager
def timing_installed() -> Iterator[StepClock]:
    """Patches ``Work.wait`` (-> ``comm_wait``), TorchRec's ``Awaitable.wait`` (-> ``emb_fwd``) and the
    plugin's ``Exchange.hand_over`` (-> ``emb_bwd``) for the block."""
    from torch.distributed.distributed_c10d import Work
    from torchrec.distributed.types import Awaitable

    from torchrec_het.sharding.common.exchange import Exchange

    work_wait, awaitable_wait, hand_over = Work.wait, Awaitable.wait, Exchange.hand_over
    Work.wait = _timed(work_wait, lambda: "comm_wait")
    Awaitable.wait = _timed(awaitable_wait, _embedding_part)
    Exchange.hand_over = _timed(hand_over, lambda: "emb_bwd")  # a callback at the end of the backward pass
    try:
        yield CLOCK
    finally:
        Work.wait, Awaitable.wait, Exchange.hand_over = work_wait, awaitable_wait, hand_over
