"""Persia's hybrid synchronization as a TorchRec train pipeline.

The dense network trains synchronously; embeddings tolerate a lag of at most
``k = embedding_staleness`` updates. The embedding forward of batch i+k starts while batch i
trains, so its all-to-alls hide behind k dense steps, and for k >= 1 the embedding backward
of batch i runs on a worker thread during the dense forward of batch i+1. At k = 0 it runs
the operations of ``TrainPipelineSparseDist``, with the same weights.

Design (step order, collective ordering, feature processors, HET bounds):
docs/internals.md#hybrid-pipeline
"""

import contextlib
import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torchrec.distributed.model_parallel import get_module
from torchrec.distributed.train_pipeline.pipeline_context import EmbeddingTrainPipelineContext
from torchrec.distributed.train_pipeline.runtime_forwards import EmbeddingPipelinedForward
from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSparseDist
from torchrec.distributed.types import LazyNoWait, ShardedModule
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedTensor

from torchrec_het import _compat
from torchrec_het.pipeline.dense_in_sparse import DenseParamsOfSparseModules

# DDP rebuilds its gradient buckets once, in the forward after its first backward, with a
# broadcast: the first batches' embedding backward stays on the main thread.
SYNC_FIRST = 2


@dataclass
class HybridContext(EmbeddingTrainPipelineContext):
    """A batch's pipeline context plus its finished embeddings and when they were read.

    Attributes:
        lookups: per sharded module, the output dist's awaitable (embedding forward started).
        embeddings: per sharded module, the pooled embeddings with detached leaves.
        updates_at_read: embedding updates applied when the lookup started.
    """

    lookups: dict[str, Any] = field(default_factory=dict)
    embeddings: dict[str, Any] = field(default_factory=dict)
    updates_at_read: int = -1


class HybridPipelinedForward(EmbeddingPipelinedForward):
    """A sharded module's forward inside the model: the embeddings the pipeline finished for the batch."""

    def __call__(self, *args, **kwargs):  # noqa: ARG002 (the inputs were consumed by the input dist)
        context = self.get_context()
        if self.name not in context.embeddings:
            raise RuntimeError(
                f"HybridTrainPipeline: the embeddings of {self.name!r} are not ready: a sharded module may "
                "run once per forward, and only inside pipeline.progress()"
            )
        return LazyNoWait(context.embeddings.pop(self.name))


class StalenessGauge:
    """How many embedding updates each trained batch missed, against synchronous training.

    Synchronous training applies batch j's read after the updates of batches 0..j-1. A batch
    looked up after ``u`` updates missed ``j - u``. Kept as a histogram (Persia's staleness
    gauge), so ``max`` is the bound that held and ``mean`` what it cost on average.
    """

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}

    def record(self, missed: int) -> None:
        self.counts[missed] = self.counts.get(missed, 0) + 1

    @property
    def max(self) -> int:
        return max(self.counts, default=0)

    @property
    def mean(self) -> float:
        total = sum(self.counts.values())
        return sum(k * n for k, n in self.counts.items()) / total if total else 0.0

    def as_dict(self) -> dict:
        return {"max": self.max, "mean": self.mean, "histogram": {str(k): n for k, n in sorted(self.counts.items())}}

    def __str__(self) -> str:
        batches = sum(self.counts.values())
        if not batches:
            return "staleness: no batch trained yet"
        spread = ", ".join(f"{n} missed {k}" for k, n in sorted(self.counts.items()))
        return (
            f"staleness over {batches} batches: a read missed at most {self.max} embedding updates, "
            f"{self.mean:.2f} on average (batches: {spread})"
        )


class HybridTrainPipeline(TrainPipelineSparseDist):
    """TorchRec's ``TrainPipeline`` with Persia's hybrid synchronization: embeddings up to k steps stale.

    A drop-in for ``TrainPipelineSparseDist``: ``progress(dataloader_iter)`` trains one batch
    and returns the model's output for it.

    Args:
        model: the ``DistributedModelParallel`` model (fused embedding optimizers).
        optimizer: the dense optimizer (a fused one's ``step`` is a no-op, so the usual
            ``CombinedOptimizer`` of both is fine).
        device: the training device.
        embedding_staleness: k >= 0, the most embedding updates a batch's read may miss.
        backward_on_worker: for k >= 1, where the embedding backward runs: True on the worker
            thread (overlapping the next dense forward), False on the main thread, None
            (default) measured: :data:`PROBE_STEPS` steps each way, then the faster on the
            ranks' summed medians; ``backward_on_worker_chosen`` says which (None while
            measuring). Models with feature processors always run it on the main thread.
        execute_all_batches: train the batches still in flight once the data runs out.
        **kwargs: passed to ``TrainPipelineSparseDist``.

    Raises:
        ValueError: k is not an int >= 0, or ``backward_on_worker`` not a bool or None; or (on
            the first ``progress``) the model has no sharded embedding module the pipeline can drive.
    """

    def __init__(
        self,
        model,
        optimizer,
        device: torch.device,
        embedding_staleness: int = 1,
        execute_all_batches: bool = True,
        backward_on_worker: bool | None = None,
        **kwargs,
    ) -> None:
        if isinstance(embedding_staleness, bool) or not isinstance(embedding_staleness, int) or embedding_staleness < 0:
            raise ValueError(f"embedding_staleness must be an int >= 0, got {embedding_staleness!r}")
        if backward_on_worker not in (True, False, None):
            raise ValueError(f"backward_on_worker must be True, False or None (measure), got {backward_on_worker!r}")
        super().__init__(
            model, optimizer, device, execute_all_batches=execute_all_batches, context_type=HybridContext, **kwargs
        )
        self.embedding_staleness = embedding_staleness
        self.gauge = StalenessGauge()
        self.updates_applied = 0  # embedding backwards finished
        self.device = device
        self.batches_trained = 0  # so batch j's read belongs after j updates in synchronous order
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="embedding-backward")
        self._pending: Future | None = None  # the embedding backward on the worker
        self._overlap = embedding_staleness >= 1
        self.backward_on_worker_chosen = backward_on_worker if self._overlap else False
        self._probe = _BackwardProbe() if self.backward_on_worker_chosen is None else None
        self._started = False
        self._dense_in_sparse: DenseParamsOfSparseModules | None = None  # set on the first progress
        # model.state_dict() (and so every checkpoint) first applies the update in flight. DMP's
        # state_dict skips its own hooks (it asks the wrapped module, whose hook runs before its
        # children's: before a sharded module's own flush); each sharded module has one too.
        wrapped = get_module(model)
        for module in [model, wrapped, *(m for m in wrapped.modules() if isinstance(m, ShardedModule))]:
            module.register_state_dict_pre_hook(lambda *_: self.drain())

    # --- filling ------------------------------------------------------------------------------

    def fill_pipeline(self, dataloader_iter) -> None:
        """At the start: batches 0..k with their input dists done, batch k+1 loaded, and (k >= 1)
        the embedding forward of batches 0..k-1 started, batch 0's finished."""
        if self._started:
            return
        if not self.enqueue_batch(dataloader_iter):
            return
        _compat.init_pipelined_modules(self, self.batches[0], self.contexts[0], HybridPipelinedForward)
        self._check_model()
        k = self.embedding_staleness
        self.wait_sparse_data_dist(self.contexts[0])
        self._started = True
        while len(self.batches) < k + 1 and self.enqueue_batch(dataloader_iter):
            self.start_sparse_data_dist(self.batches[-1], self.contexts[-1])
            self.wait_sparse_data_dist(self.contexts[-1])
        self.enqueue_batch(dataloader_iter)  # batch k+1: its input dist starts in the first step
        for position in range(min(k, len(self.batches))):
            self._start_lookup(position)
        if k >= 1:
            self._finish_lookup(0)

    def _check_model(self) -> None:
        if not _compat.pipelined_modules(self):
            raise ValueError(
                "HybridTrainPipeline: the model has no sharded embedding module it can pipeline (none was "
                "found by tracing the model, or none is sharded): use TrainPipelineSparseDist or a plain loop"
            )
        if self.embedding_staleness >= 1:  # HET caches: later batches may settle before a backward
            for module in _compat.pipelined_modules(self):
                for lookup in _compat.sharded_lookups(module):
                    allow = getattr(lookup, "allow_batches_ahead", None)  # the hook of lookups that need it told
                    if allow is not None:
                        allow()
        model = _compat.pipeline_model(self)
        if any(isinstance(m, DistributedDataParallel) and m.will_sync_module_buffers() for m in model.modules()):
            self._overlap = False  # DDP's forward broadcasts buffers: a collective, so no worker beside it
            self.backward_on_worker_chosen, self._probe = False, None
        self._dense_in_sparse = DenseParamsOfSparseModules(model, _compat.pipelined_modules(self))
        if self._dense_in_sparse:
            # e.g. a feature processor's weights: DDP's parameters whose gradients the embedding
            # backward makes. It runs before the dense step, on this thread: on the worker it
            # would fire DDP's hooks inside the next forward's reduction.
            self._overlap = False
            self.backward_on_worker_chosen, self._probe = False, None

    # --- one step -----------------------------------------------------------------------------

    def progress(self, dataloader_iter):
        """Trains the next batch; returns the model's output for it (StopIteration when none is left)."""
        _compat.pipeline_attach_if_detached(self)
        self.fill_pipeline(dataloader_iter)
        if not self.batches:
            self.drain()
            raise StopIteration
        k, context = self.embedding_staleness, self.contexts[0]
        training = _compat.pipeline_model(self).training
        optimizer = _compat.pipeline_optimizer(self)
        if training:
            optimizer.zero_grad()
        if k == 0:  # TrainPipelineSparseDist's order: next input dist, then this batch's embedding forward
            self._start_input_dist(dataloader_iter)
            self._start_lookup(0)
            self._finish_lookup(0)
        if training:
            self.gauge.record(self.batches_trained - context.updates_at_read)
        losses, output = _compat.pipeline_model_forward(self, self.batches[0])
        if k >= 1:
            self.drain()  # every update up to the previous batch is applied
            self._start_input_dist(dataloader_iter)
            if len(self.batches) > k:
                self._start_lookup(k)
        if len(self.batches) > k + 1:
            self.wait_sparse_data_dist(self.contexts[k + 1])
        if training:
            torch.sum(losses, dim=0).backward()
            _compat.sync_embeddings(self, context)
            if self._dense_in_sparse:
                self._embedding_backward(context)
                self._dense_in_sparse.all_reduce_grads()
            optimizer.step()
        if k >= 1 and len(self.batches) > 1:
            self._finish_lookup(1)
        if training:
            self.batches_trained += 1
            if self._dense_in_sparse:  # its embedding backward ran before the dense step
                pass
            elif self._backward_on_worker():
                self._pending = self._worker.submit(self._embedding_backward, context)
            else:
                self._embedding_backward(context)
        self.dequeue_batch()
        return output

    def _backward_on_worker(self) -> bool:
        """Whether this step's embedding backward goes to the worker (see ``backward_on_worker``)."""
        if not self._overlap or self.batches_trained <= SYNC_FIRST:
            return False
        if self._probe is None:
            return bool(self.backward_on_worker_chosen)
        on_worker = self._probe.next_step_on_worker(self.batches_trained - SYNC_FIRST)
        if on_worker is None:  # both ways measured: every rank takes the same choice
            self.drain()  # no collective beside the worker's
            self.backward_on_worker_chosen = self._probe.choose()
            self._probe = None
            return self.backward_on_worker_chosen
        return on_worker

    def _start_input_dist(self, dataloader_iter) -> None:
        """Starts the input dist of batch k+1 (held, not started) and loads batch k+2."""
        k = self.embedding_staleness
        if len(self.batches) > k + 1:
            self.start_sparse_data_dist(self.batches[k + 1], self.contexts[k + 1])
        self.enqueue_batch(dataloader_iter)

    def _start_lookup(self, position: int) -> None:
        """Starts the embedding forward (lookup and output dist) of ``batches[position]``."""
        context = self.contexts[position]
        stream = _compat.pipeline_data_dist_stream(self)
        keep_reads = self.embedding_staleness >= 1 and self._dense_in_sparse
        for module in _compat.pipelined_modules(self):
            name = module.forward.name
            features = context.input_dist_tensors_requests.pop(name).wait()
            if stream is not None:  # the input dist ran on the data-dist stream
                torch.get_device_module(self.device).current_stream().wait_stream(stream)
            with self._dense_in_sparse.read_as_of_now() if keep_reads else contextlib.nullcontext():
                context.lookups[name] = module.compute_and_output_dist(context.module_contexts.pop(name), features)
        context.updates_at_read = self.updates_applied

    def _finish_lookup(self, position: int) -> None:
        """Waits ``batches[position]``'s output dists; keeps its embeddings as detached leaves."""
        context = self.contexts[position]
        for name, awaitable in context.lookups.items():
            context.embeddings[name] = _detached(awaitable.wait(), context)
        context.lookups.clear()

    def _embedding_backward(self, context: HybridContext) -> None:
        """The embedding backward of a trained batch: gradients through the output dist and the
        lookup (the fused optimizers update there)."""
        tensors, grads = [], []
        for originals, leaves in zip(context.embedding_tensors, context.detached_embedding_tensors):
            for original, leaf in zip(originals, leaves):
                if leaf.grad is not None:
                    tensors.append(original)
                    grads.append(leaf.grad)
        if tensors:
            torch.autograd.backward(tensors, grads)
        # The batch's graph is spent: freed here, not when the worker thread drops its task later.
        context.embedding_tensors.clear()
        context.detached_embedding_tensors.clear()
        self.updates_applied += 1

    # --- draining -----------------------------------------------------------------------------

    def drain(self) -> None:
        """Waits for the embedding update in flight on the worker (and re-raises its error).

        Call it before ``state_dict()`` or a checkpoint. Batches already looked up ahead keep
        the embeddings they read: they train as read.
        """
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def reset(self) -> None:
        """Drains, then drops the batches in flight (``TrainPipelineSparseDist.reset``); the next
        ``progress`` fills the pipeline again."""
        self.drain()
        super().reset()
        self._started = False

    def detach(self) -> torch.nn.Module:
        """Drains, then gives the model its own forwards back (see ``TrainPipelineSparseDist.detach``)."""
        self.drain()
        return super().detach()


PROBE_STEPS = 8  # steps timed each way before ``backward_on_worker=None`` chooses


class _BackwardProbe:
    """Times steps with the embedding backward on the main thread, then on the worker: a step's
    time is from one backward's start to the next (the worker's run overlaps the step after it)."""

    def __init__(self) -> None:
        self.inline: list[float] = []
        self.worker: list[float] = []
        self._last: tuple[float, bool] | None = None

    def next_step_on_worker(self, step: int) -> bool | None:
        """Where the backward of the ``step``-th probed step runs; None once both ways are measured."""
        now = time.perf_counter()
        if self._last is not None:
            start, on_worker = self._last
            (self.worker if on_worker else self.inline).append(now - start)
        if step > 2 * PROBE_STEPS:
            return None
        on_worker = step > PROBE_STEPS
        self._last = (now, on_worker)
        return on_worker

    def choose(self) -> bool:
        """The worker when its median step time, summed over ranks, is below the main thread's."""
        medians = torch.tensor([statistics.median(self.inline), statistics.median(self.worker)], dtype=torch.float64)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(medians)
        return bool(medians[1] < medians[0])


def _detached(embeddings, context: HybridContext):
    """The pooled embeddings with their values swapped for leaves that collect the dense gradient."""
    if isinstance(embeddings, KeyedTensor):
        values = embeddings.values()
        leaf = values.detach().requires_grad_()
        context.embedding_tensors.append([values])
        context.embedding_features.append([list(embeddings.keys())])
        context.detached_embedding_tensors.append([leaf])
        return KeyedTensor(embeddings.keys(), embeddings.length_per_key(), leaf, embeddings.key_dim())
    if isinstance(embeddings, dict):
        originals, leaves, out = [], [], {}
        for key, jt in embeddings.items():
            leaf = jt.values().detach().requires_grad_()
            originals.append(jt.values())
            leaves.append(leaf)
            out[key] = JaggedTensor(
                values=leaf, weights=jt.weights_or_none(), lengths=jt.lengths(), offsets=jt.offsets()
            )
        context.embedding_tensors.append(originals)
        context.embedding_features.append(list(embeddings))
        context.detached_embedding_tensors.append(leaves)
        return out
    raise TypeError(f"HybridTrainPipeline cannot pipeline a sharded module that returns {type(embeddings).__name__}")
