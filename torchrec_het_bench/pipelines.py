"""The training loops a benchmark entry can run under (``--pipeline``).

``sparse_dist`` (the default) is TorchRec's ``TrainPipelineSparseDist``, the pipeline users
train with: on its first ``progress()`` it fx-traces the model, swaps each top-level sharded
module's ``forward`` for one that reads its input from the pipeline's context, and from then
on, while batch i trains, it runs batch i+1's input dist (ids to their owners) and loads
batch i+2. It holds two batches beyond the one it trains (:attr:`PipelineKind.lookahead`)
and does ``zero_grad``, forward, backward and ``optimizer.step()`` itself; its output is
the model's, ``(loss, logits, labels)`` for both workloads. ``plain`` is the loop of
:func:`~torchrec_het_bench.model.train_step`: one batch, forward, backward, step.

``hybrid`` is :class:`torchrec_het.pipeline.HybridTrainPipeline` (Persia's hybrid
synchronization) with ``--embedding-staleness k``: the embedding forward of batch i+k runs
while batch i trains, embedding updates land up to k batches late, the dense all-reduce
stays synchronous. ``semi_sync`` is TorchRec's ``TrainPipelineSemiSync`` (a batch's
embeddings are looked up before the previous batch's embedding update: at B-2), semi-sync
from the first batch (``start_batch=0``; TorchRec's default of 900 would train the
benchmark's whole run synchronously), built by
:func:`torchrec_het.pipeline.semi_sync_pipeline_class`, whose CPU adapter skips only the
CUDA stream bookkeeping (``record_stream``) that TorchRec 1.8.0 and 1.9.2 do on CPU tensors too.

Every kind is a :class:`PipelineKind` in :data:`PIPELINES`, built from :func:`pipeline_kinds`
(a new kind goes there). A kind names the devices it runs on (none where the installed
TorchRec lacks it): :func:`check_pipeline` tells, before any rank starts, that a device cannot
run it. On CPU, TorchRec's ``PrefetchTrainPipelineSparseDist`` and 1.9's ``TrainPipelinePEC``
cannot run (each kind's ``why_not`` quotes the error); they are offered for devices that can. A run
trains every configuration under each pipeline it names (:func:`parse_pipelines`), each
pair its own entry (:class:`PipelineRun` says how the entry is named).

Evaluation in the middle of a run (:meth:`TorchRecLoop.evaluate`) never detaches the
pipeline: see there.
"""

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from torchrec_het_bench.config_types import by_name
from torchrec_het_bench.model import ShardedModel, predict, train_step


class BatchFeed:
    """A configuration's batches in training order: an iterator the worker appends to ahead of time.

    TorchRec's pipelines consume a dataloader iterator and mark it exhausted for good the first
    time ``next()`` finds nothing, so the worker keeps at least the steps it is about to run plus
    the pipeline's :attr:`PipelineRun.lookahead` in here (one feed serves the whole run), and
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


class PipelineRefused(Exception):
    """A pipeline's first ``progress()`` refused the configuration's model (a ``ValueError`` of its
    own checks, e.g. the hybrid pipeline's for a model without a sharded module it can pipeline);
    the message is the pipeline's, on one line."""


class PlainLoop:
    """One batch per step: forward, backward, optimizer step (:func:`~torchrec_het_bench.model.train_step`)."""

    def __init__(self, sharded: ShardedModel, feed: BatchFeed, device: torch.device) -> None:
        self.sharded, self.feed = sharded, feed

    def step(self) -> float:
        """Trains the feed's next batch; returns its local loss."""
        return train_step(self.sharded, next(self.feed))

    def evaluate(self, batches: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Click probabilities and labels of held-out batches with the model as trained so far."""
        return [predict(self.sharded.model, batch) for batch in batches]

    def settle(self) -> None:
        """Nothing runs beside the caller."""

    def staleness_gauge(self) -> dict | None:
        """No gauge: every read sees every earlier update."""
        return None

    def finish(self) -> None:
        """Nothing to undo."""


class TorchRecLoop:
    """A TorchRec train pipeline (``pipeline_class(model, optimizer, device)``) stepped with ``progress(feed)``.

    One pipeline per entry for the whole run, so the model is rewritten once (on the first
    step, in warm-up) and batches stay in flight between the rounds of the benchmark.
    """

    def __init__(self, pipeline_class: Callable, sharded: ShardedModel, feed: BatchFeed, device: torch.device) -> None:
        self.sharded, self.feed, self.device = sharded, feed, device
        self.pipeline = pipeline_class(sharded.model, sharded.optimizer, device)
        self.started = False

    def step(self) -> float:
        """Trains the next batch (the pipeline pulls further batches from the feed); returns its local loss.

        Raises:
            PipelineRefused: the first ``progress()`` raised ``ValueError`` (the pipeline's own
                check of the model: the same on every rank, before it waits on any other rank).
        """
        if not len(self.feed) and not self.feed.closed:
            # An exhausted iterator stays exhausted for the pipeline: never let that happen mid-run.
            raise RuntimeError("the batch feed ran dry: the worker must queue the pipeline's lookahead")
        if not self.started:
            self.started = True
            try:
                output = self.pipeline.progress(self.feed)
            except ValueError as error:
                raise PipelineRefused(" ".join(str(error).split())) from error
        else:
            output = self.pipeline.progress(self.feed)
        loss, _logits, _labels = output
        return float(loss)

    def settle(self) -> None:
        """Waits for the work the pipeline runs beside the caller's thread: the hybrid pipeline's
        embedding backward of the last batch, on its worker thread (``drain()``).

        The worker issues collectives; another entry's (or a barrier, or an evaluation) issued
        meanwhile from the main thread would interleave with them differently on each rank (gloo
        matches collectives by the order they are issued), so the benchmark settles an entry before
        it leaves it. Nothing the training computes changes: the next step would wait for that
        update before its next lookup anyway. Pipelines without a ``drain()`` leave only collectives
        issued from the main thread in flight, which every rank issues in the same order.
        """
        drain = getattr(self.pipeline, "drain", None)
        if drain is not None:
            drain()

    def evaluate(self, batches: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Click probabilities and labels of held-out batches with the model as trained so far,
        the pipeline staying attached with its batches in flight.

        Each held-out batch gets a fresh ``TrainPipelineContext``: its input dist runs through the
        pipeline's own ``start_sparse_data_dist`` / ``wait_sparse_data_dist`` (the traced argument
        paths and the fused splits exchange, as for a training batch), then, with every pipelined
        sharded module's ``forward`` set for the moment to TorchRec's ``PipelinedForward`` on that
        context, the model runs in eval mode without gradients (:func:`~torchrec_het_bench.model.predict`),
        and each module gets back the forward the pipeline gave it, still bound to the pipeline's own
        context. What the pipeline holds is not touched: batches loaded, their input dists started or
        done, their contexts (with the hybrid pipeline's embeddings looked up ahead) and the modules'
        forwards. ``detach()``/``attach()`` would not do: ``attach()`` re-traces the model and restarts
        the input dist of the batch at the head of the queue, whose input dist already ran.

        The pipeline is settled first (:meth:`settle`): the hybrid one's embedding backward may be
        running on a worker thread, whose collectives must not interleave with the evaluation's.
        That only applies now the update the next ``progress()`` would wait for anyway, before its
        next lookup: the trained model and the staleness gauge are unchanged.

        The held-out weights are those after every step trained so far: under every pipeline,
        ``progress()`` returns after its batch's embedding and dense updates (the hybrid one's
        embedding update once drained).
        """
        from torchrec_het import _compat

        modules = _compat.pipelined_modules(self.pipeline)
        if not modules:  # not started yet: the model has its own forwards
            return [predict(self.sharded.model, batch) for batch in batches]
        from torchrec.distributed.train_pipeline.pipeline_context import TrainPipelineContext
        from torchrec.distributed.train_pipeline.runtime_forwards import PipelinedForward

        self.settle()
        stream = _compat.pipeline_data_dist_stream(self.pipeline)
        forwards = [module.forward for module in modules]
        out = []
        for batch in batches:
            context = TrainPipelineContext(index=-1, version=1)
            self.pipeline.start_sparse_data_dist(batch, context)  # with the pipeline's forwards in place
            self.pipeline.wait_sparse_data_dist(context)
            try:
                for module, forward in zip(modules, forwards):
                    module.forward = PipelinedForward(forward.name, forward.args, module, context, stream)
                out.append(predict(self.sharded.model, batch))
            finally:
                for module, forward in zip(modules, forwards):
                    module.forward = forward
        return out

    def staleness_gauge(self) -> dict | None:
        """The pipeline's staleness gauge (``{"max", "mean", "histogram"}``), if it keeps one, with
        where its embedding backward ran (``backward_on_worker``: the hybrid pipeline's choice)."""
        gauge = getattr(self.pipeline, "gauge", None)
        if gauge is None:
            return None
        return dict(gauge.as_dict(), backward_on_worker=getattr(self.pipeline, "backward_on_worker_chosen", None))

    def finish(self) -> None:
        """Gives the model its own forwards back (for the final evaluation); batches still in flight
        are dropped (the hybrid pipeline first applies the embedding update in flight)."""
        self.pipeline.detach()


LoopMaker = Callable[[ShardedModel, BatchFeed, torch.device, int], "PlainLoop | TorchRecLoop"]


@dataclass(frozen=True)
class PipelineKind:
    """A training loop the benchmark offers.

    Attributes:
        name: the ``--pipeline`` value, recorded as ``params.pipeline``.
        description: one line for ``--help``.
        make: builds the loop of one entry: ``make(sharded, feed, device, embedding_staleness)``.
        lookahead: batches beyond the current one the loop takes from its feed (plus k where
            the staleness is ``--embedding-staleness``).
        staleness: the most embedding updates a batch's read misses, by the pipeline's design
            (0: synchronous; TorchRec's semi-sync: 1); None: ``--embedding-staleness`` sets it.
        device_types: devices it runs on.
        why_not: why it does not run on the other devices.
        refuses: ``refuses(sharded)``: why the pipeline cannot train that model (one line), or
            None; checked before the loop is built, for pipelines that do not check themselves
            (a pipeline's own ``ValueError`` at its first step is :class:`PipelineRefused` too).
    """

    name: str
    description: str
    make: LoopMaker
    lookahead: int
    staleness: int | None = 0
    device_types: tuple[str, ...] = ("cpu", "cuda")
    why_not: str = ""
    refuses: Callable[[ShardedModel], str | None] | None = None


@dataclass(frozen=True)
class PipelineRun:
    """A pipeline as one run uses it: its kind and its embedding staleness k.

    Attributes:
        kind: the pipeline.
        embedding_staleness: k: ``--embedding-staleness`` for a kind that takes it, else the
            kind's own (:attr:`PipelineKind.staleness`).
    """

    kind: PipelineKind
    embedding_staleness: int

    @property
    def name(self) -> str:
        return self.kind.name

    @property
    def label(self) -> str:
        """How entry names show the pipeline: ``hybrid_k2``, or the kind's name."""
        return f"{self.name}_k{self.embedding_staleness}" if self.kind.staleness is None else self.name

    @property
    def lookahead(self) -> int:
        return self.kind.lookahead + (self.embedding_staleness if self.kind.staleness is None else 0)

    def make(self, sharded: ShardedModel, feed: BatchFeed, device: torch.device) -> "PlainLoop | TorchRecLoop":
        return self.kind.make(sharded, feed, device, self.embedding_staleness)

    def refusal(self, sharded: ShardedModel) -> str | None:
        """Why this pipeline cannot train ``sharded`` (known before it runs), or None."""
        return None if self.kind.refuses is None else self.kind.refuses(sharded)


def entry_name(config: str, run: PipelineRun, several: bool) -> str:
    """An entry's name: the configuration's, and ``@`` the pipeline's label when a run has several."""
    return f"{config}@{run.label}" if several else config


def _plain(sharded: ShardedModel, feed: BatchFeed, device: torch.device, k: int) -> PlainLoop:  # noqa: ARG001
    return PlainLoop(sharded, feed, device)


def _torchrec(class_name: str) -> LoopMaker:
    def make(sharded: ShardedModel, feed: BatchFeed, device: torch.device, k: int) -> TorchRecLoop:  # noqa: ARG001
        from torchrec.distributed.train_pipeline import train_pipelines

        return TorchRecLoop(getattr(train_pipelines, class_name), sharded, feed, device)

    return make


def _semi_sync_refuses(sharded: ShardedModel) -> str | None:
    from torchrec.distributed.types import ShardingType

    from torchrec_het.types import HET_CACHED_ROW_WISE

    if HET_CACHED_ROW_WISE in sharded.sharding_types:
        return (
            "TorchRec's TrainPipelineSemiSync starts a batch's embedding lookup before the previous batch's "
            "embedding backward, and het_cached_row_wise needs each batch's backward before the next forward "
            "(it raises 'a backward must follow its own forward before the next forward runs')"
        )
    if ShardingType.DATA_PARALLEL.value in sharded.sharding_types:
        return (
            "TorchRec 1.8's TrainPipelineSemiSync cannot train data_parallel tables: their weights are dense "
            "parameters (TorchRec keeps them out of the fused optimizer), so the optimizer the pipeline steps "
            "after each batch updates them in place, after it has started the next batch's lookup, whose "
            "backward needs the weights that lookup read (autograd: 'one of the variables needed for gradient "
            "computation has been modified by an inplace operation'; TorchRec warns first: 'SemiSync pipelined "
            "ShardedEmbeddingBagCollection and optimizer share parameters')"
        )
    return None


def _semi_sync(sharded: ShardedModel, feed: BatchFeed, device: torch.device, k: int) -> TorchRecLoop:  # noqa: ARG001
    from torchrec_het.pipeline import semi_sync_pipeline_class

    cls = semi_sync_pipeline_class()
    return TorchRecLoop(lambda model, optimizer, dev: cls(model, optimizer, dev, start_batch=0), sharded, feed, device)


def _hybrid(sharded: ShardedModel, feed: BatchFeed, device: torch.device, k: int) -> TorchRecLoop:
    from torchrec_het.pipeline import HybridTrainPipeline

    return TorchRecLoop(
        lambda model, optimizer, dev: HybridTrainPipeline(model, optimizer, dev, embedding_staleness=k),
        sharded,
        feed,
        device,
    )


def pipeline_kinds() -> list[PipelineKind]:
    """Every training loop the benchmark offers, in ``--help`` order."""
    return [
        PipelineKind("plain", "forward, backward, optimizer step, one batch at a time", _plain, lookahead=0),
        PipelineKind(
            "sparse_dist",
            "TorchRec's TrainPipelineSparseDist: the next batch's input dist overlaps this batch's step",
            _torchrec("TrainPipelineSparseDist"),
            lookahead=2,
        ),
        PipelineKind(
            "hybrid",
            "torchrec_het's HybridTrainPipeline (Persia): embedding lookups k batches ahead, embedding updates "
            "up to k batches late, dense all-reduce synchronous (k: --embedding-staleness)",
            _hybrid,
            lookahead=2,
            staleness=None,
        ),
        PipelineKind(
            "semi_sync",
            "TorchRec's TrainPipelineSemiSync (embeddings at B-2: a batch's lookup misses the previous batch's "
            "update), semi-sync from the first batch, with torchrec_het's CPU adapter (skips only record_stream on CPU)",
            _semi_sync,
            lookahead=3,
            staleness=1,
            refuses=_semi_sync_refuses,
        ),
        PipelineKind(
            "prefetch_sparse_dist",
            "TorchRec's PrefetchTrainPipelineSparseDist (embedding cache prefetch)",
            _torchrec("PrefetchTrainPipelineSparseDist"),
            lookahead=3,
            device_types=("cuda",),
            why_not="TorchRec's PrefetchTrainPipelineSparseDist (1.8.0 and 1.9.2) fails on CPU "
            "('Invalid PrefetchPipelinedForward usage, please do not directly call model.forward()'): "
            "without a data-dist stream its prefetch_embeddings returns before it prefetches anything",
        ),
        _pec_kind(),
    ]


def _pec(sharded: ShardedModel, feed: BatchFeed, device: torch.device, k: int) -> TorchRecLoop:  # noqa: ARG001
    from torchrec_het import _compat

    return TorchRecLoop(_compat.pec_train_pipeline_class(), sharded, feed, device)


def _pec_kind() -> PipelineKind:
    import torchrec

    from torchrec_het import _compat

    on_this_torchrec = _compat.pec_train_pipeline_class() is not None
    return PipelineKind(
        "pec",
        "TorchRec 1.9's TrainPipelinePEC (compute-ahead pipeline for PEC EmbeddingCollections)",
        _pec,
        lookahead=2,
        device_types=("cuda",) if on_this_torchrec else (),
        why_not="TorchRec 1.9.2's TrainPipelinePEC fails on CPU ('Found no NVIDIA driver on your system'): its "
        "fill_pipeline records a torch.cuda.Event on the data-dist stream"
        if on_this_torchrec
        else f"TrainPipelinePEC is new in TorchRec 1.9; torchrec {torchrec.__version__} is installed",
    )


PIPELINES: dict[str, PipelineKind] = by_name(pipeline_kinds(), "pipeline")

DEFAULT_PIPELINE = "sparse_dist"
DEFAULT_EMBEDDING_STALENESS = 2


class PipelineUnavailable(ValueError):
    """The pipeline does not exist or cannot run on the device."""


def check_pipeline(name: str, device: torch.device) -> PipelineKind:
    """The kind named ``name`` if it runs on ``device``.

    Raises:
        PipelineUnavailable: one line that says which pipeline, which device and why.
    """
    kind = PIPELINES.get(name)
    if kind is None:
        raise PipelineUnavailable(f"--pipeline: unknown pipeline {name!r}; choose from {sorted(PIPELINES)}")
    if not kind.device_types:
        raise PipelineUnavailable(f"--pipeline {name} cannot run here: {kind.why_not}")
    if device.type not in kind.device_types:
        raise PipelineUnavailable(
            f"--pipeline {name} cannot run on this device ({device.type}): {kind.why_not}; "
            f"use one of {sorted(n for n, k in PIPELINES.items() if device.type in k.device_types)}"
        )
    return kind


def check_embedding_staleness(k: object) -> int:
    """``--embedding-staleness``: an int >= 0.

    Raises:
        PipelineUnavailable: one line naming the flag.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise PipelineUnavailable(f"--embedding-staleness must be an int >= 0, got {k!r}")
    return k


def parse_pipelines(text: str, embedding_staleness: int, device: torch.device) -> list[PipelineRun]:
    """The pipelines of ``--pipeline`` (comma-separated, in order) as this run uses them.

    Raises:
        PipelineUnavailable: an unknown or repeated name, one the device cannot run, none at all,
            or a bad ``embedding_staleness`` (checked whether or not a pipeline takes it).
    """
    k = check_embedding_staleness(embedding_staleness)
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise PipelineUnavailable("--pipeline names no pipeline")
    if len(set(names)) != len(names):
        raise PipelineUnavailable(f"--pipeline names a pipeline twice: {','.join(names)}")
    runs = []
    for name in names:
        kind = check_pipeline(name, device)
        runs.append(PipelineRun(kind, k if kind.staleness is None else kind.staleness))
    return runs
