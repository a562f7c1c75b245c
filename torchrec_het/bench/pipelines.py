"""The training loops a benchmark configuration can run under (``--pipeline``).

``sparse_dist`` (the default) is TorchRec's ``TrainPipelineSparseDist``, the pipeline users
train with: on its first ``progress()`` it fx-traces the model, swaps each top-level sharded
module's ``forward`` for one that reads its input from the pipeline's context, and from then
on, while batch i trains, it runs batch i+1's input dist (ids to their owners) and loads
batch i+2. It holds two batches beyond the one it trains (:attr:`PipelineKind.lookahead`)
and does ``zero_grad``, forward, backward and ``optimizer.step()`` itself; its output is
the model's, ``(loss, logits, labels)`` for both workloads. ``plain`` is the loop of
:func:`~torchrec_het.bench.model.train_step`: one batch, forward, backward, step.

Every kind is a :class:`PipelineKind` in :data:`PIPELINES`; a later pipeline (the hybrid
one) registers itself with :func:`register_pipeline`. A kind names the devices it runs
on: :func:`check_pipeline` tells, before any rank starts, that a device cannot run it.
On CPU with TorchRec 1.8, ``PrefetchTrainPipelineSparseDist`` and ``TrainPipelineSemiSync``
cannot run (see :data:`PIPELINES`); they are offered for devices that can.
"""

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from torchrec_het.bench.configs import add_unique
from torchrec_het.bench.model import ShardedModel, train_step


class BatchFeed:
    """A configuration's batches in training order: an iterator the worker appends to ahead of time.

    TorchRec's pipelines consume a dataloader iterator and mark it exhausted for good the first
    time ``next()`` finds nothing, so the worker keeps at least the steps it is about to run plus
    the pipeline's :attr:`PipelineKind.lookahead` in here (one feed serves the whole run), and
    :meth:`close` s it once the last batch is in (then running dry is the end of the data).
    """

    def __init__(self) -> None:
        self._queue: deque = deque()
        self.closed = False

    def extend(self, batches: Iterable) -> None:
        if self.closed:
            raise RuntimeError("the batch feed is closed")
        self._queue.extend(batches)

    def close(self) -> None:
        """No more batches will come."""
        self.closed = True

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> "BatchFeed":
        return self

    def __next__(self):
        if not self._queue:
            raise StopIteration
        return self._queue.popleft()


class PlainLoop:
    """One batch per step: forward, backward, optimizer step (:func:`~torchrec_het.bench.model.train_step`)."""

    def __init__(self, sharded: ShardedModel, feed: BatchFeed, device: torch.device) -> None:
        self.sharded, self.feed = sharded, feed

    def step(self) -> float:
        """Trains the feed's next batch; returns its local loss."""
        return train_step(self.sharded, next(self.feed))

    def finish(self) -> None:
        """Nothing to undo."""


class TorchRecLoop:
    """A TorchRec train pipeline (``pipeline_class(model, optimizer, device)``) stepped with ``progress(feed)``.

    One pipeline per configuration for the whole run, so the model is rewritten once (on the
    first step, in warm-up) and batches stay in flight between the rounds of the benchmark.
    """

    def __init__(self, pipeline_class: type, sharded: ShardedModel, feed: BatchFeed, device: torch.device) -> None:
        self.feed = feed
        self.pipeline = pipeline_class(sharded.model, sharded.optimizer, device)

    def step(self) -> float:
        """Trains the next batch (the pipeline pulls further batches from the feed); returns its local loss."""
        if not len(self.feed) and not self.feed.closed:
            # An exhausted iterator stays exhausted for the pipeline: never let that happen mid-run.
            raise RuntimeError("the batch feed ran dry: the worker must queue the pipeline's lookahead")
        loss, _logits, _labels = self.pipeline.progress(self.feed)
        return float(loss)

    def finish(self) -> None:
        """Gives the model its own forwards back (for evaluation); batches still in flight are dropped."""
        self.pipeline.detach()


@dataclass(frozen=True)
class PipelineKind:
    """A training loop the benchmark offers.

    Attributes:
        name: the ``--pipeline`` value, recorded as ``params.pipeline``.
        description: one line for ``--help``.
        make: builds the loop of one configuration: ``make(sharded, feed, device)``.
        lookahead: batches beyond the current one the loop takes from its feed.
        device_types: devices it runs on.
        why_not: why it does not run on the other devices.
    """

    name: str
    description: str
    make: Callable[[ShardedModel, BatchFeed, torch.device], "PlainLoop | TorchRecLoop"]
    lookahead: int
    device_types: tuple[str, ...] = ("cpu", "cuda")
    why_not: str = ""


def _torchrec(class_name: str) -> Callable:
    def make(sharded: ShardedModel, feed: BatchFeed, device: torch.device) -> TorchRecLoop:
        from torchrec.distributed.train_pipeline import train_pipelines

        return TorchRecLoop(getattr(train_pipelines, class_name), sharded, feed, device)

    return make


PIPELINES: dict[str, PipelineKind] = {}


def register_pipeline(kind: PipelineKind) -> PipelineKind:
    """Adds a kind to :data:`PIPELINES`; names are unique."""
    return add_unique(PIPELINES, kind.name, kind, "pipeline")


register_pipeline(PipelineKind("plain", "forward, backward, optimizer step, one batch at a time", PlainLoop, lookahead=0))
register_pipeline(
    PipelineKind(
        "sparse_dist",
        "TorchRec's TrainPipelineSparseDist: the next batch's input dist overlaps this batch's step",
        _torchrec("TrainPipelineSparseDist"),
        lookahead=2,
    )
)
register_pipeline(
    PipelineKind(
        "prefetch_sparse_dist",
        "TorchRec's PrefetchTrainPipelineSparseDist (embedding cache prefetch)",
        _torchrec("PrefetchTrainPipelineSparseDist"),
        lookahead=3,
        device_types=("cuda",),
        why_not="TorchRec 1.8's PrefetchTrainPipelineSparseDist fails on CPU "
        "('Invalid PrefetchPipelinedForward usage, please do not directly call model.forward()')",
    )
)
register_pipeline(
    PipelineKind(
        "semi_sync",
        "TorchRec's TrainPipelineSemiSync (embedding lookups a batch ahead)",
        _torchrec("TrainPipelineSemiSync"),
        lookahead=3,
        device_types=("cuda",),
        why_not="TorchRec 1.8's TrainPipelineSemiSync calls record_stream on CPU tensors ('unknown parameter type')",
    )
)

DEFAULT_PIPELINE = "sparse_dist"


class PipelineUnavailable(ValueError):
    """The pipeline does not exist or cannot run on the device."""


def check_pipeline(name: str, device: torch.device) -> PipelineKind:
    """The kind named ``name`` if it runs on ``device``.

    Raises:
        PipelineUnavailable: one line that says which pipeline, which device and why.
    """
    kind = PIPELINES.get(name)
    if kind is None:
        raise PipelineUnavailable(f"unknown pipeline {name!r}; choose from {sorted(PIPELINES)}")
    if device.type not in kind.device_types:
        raise PipelineUnavailable(
            f"--pipeline {name} cannot run on this device ({device.type}): {kind.why_not}; "
            f"use one of {sorted(n for n, k in PIPELINES.items() if device.type in k.device_types)}"
        )
    return kind
