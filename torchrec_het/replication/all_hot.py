"""FAE's loader wrapper: regroup batches so that hot samples fill whole batches.

A ``het_row_replicated`` step skips its cold exchange when no rank reads a row it does
not hold. With many features per sample that rarely happens by chance, so
:class:`AllHotBatches` buffers a window of batches, sorts each rank's samples into those
it can look up locally ("hot", from the sharded module's ``samples_read_here``) and the
rest, and emits the window again with as many all-hot batches as *every* rank can fill
(one small all-reduce per window), at the same steps on every rank, spread evenly over
the window. Batch sizes and the multiset of samples are unchanged; only their order
within a window moves. Off by default: a user wraps their loader to opt in.
"""

from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het._compat import collective_device

Classifier = Callable[[KeyedJaggedTensor], torch.Tensor]


class AllHotBatches:
    """Wraps an iterable of TorchRec ``Batch``es; every rank wraps its own, window by window.

    Args:
        batches: this rank's batches (``dense_features``, ``sparse_features``, ``labels``).
        read_here: bool ``[batch]`` per KJT, True for samples needing no other rank (e.g. a
            sharded module's ``samples_read_here``, or :func:`read_here_of` of a model).
        window: batches regrouped together; every rank must yield the same number of batches.
        group: process group that agrees on the all-hot steps (None: the default group, or
            this process alone when torch.distributed is not initialized).

    Attributes:
        stats: ``windows``, ``batches`` and ``all_hot_batches`` emitted so far.
    """

    def __init__(self, batches: Iterable[Batch], read_here: Classifier, window: int = 16, group=None) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self._batches, self._read_here, self._window, self._group = batches, read_here, window, group
        self.stats = {"windows": 0, "batches": 0, "all_hot_batches": 0}

    def __iter__(self) -> Iterator[Batch]:
        source = iter(self._batches)
        while True:
            window = [b for _, b in zip(range(self._window), source)]
            yield from self._regroup(window)
            if len(window) < self._window:
                return

    def _regroup(self, window: list[Batch]) -> list[Batch]:
        sizes = [int(b.labels.shape[0]) for b in window]
        hot = (
            torch.cat([self._read_here(b.sparse_features) for b in window])
            if window
            else torch.zeros(0, dtype=torch.bool)
        )
        if hot.numel() != sum(sizes):
            raise ValueError(f"read_here gave {hot.numel()} flags for {sum(sizes)} samples")
        count = self._agree(fillable_batches(sizes, int(hot.sum())), len(window))
        if not window:
            return []
        positions = set(spread(count, len(window)))
        hot_order, rest_order = hot.nonzero().flatten(), (~hot).nonzero().flatten()
        needed = sum(sizes[p] for p in positions)
        rest_order = torch.sort(torch.cat([rest_order, hot_order[needed:]])).values  # stream order
        hot_order = hot_order[:needed]
        out, taken = [], {True: 0, False: 0}
        for p, size in enumerate(sizes):
            is_hot = p in positions
            order = hot_order if is_hot else rest_order
            out.append(take_samples(window, order[taken[is_hot] : taken[is_hot] + size]))
            taken[is_hot] += size
        self.stats["windows"] += 1
        self.stats["batches"] += len(window)
        self.stats["all_hot_batches"] += count
        return out

    def _agree(self, fillable: int, batches: int) -> int:
        """All-hot batches every rank can fill; ValueError on all ranks if their windows differ in length."""
        if not dist.is_initialized():
            return fillable
        facts = torch.tensor([fillable, batches, -batches], dtype=torch.int64, device=collective_device(self._group))
        dist.all_reduce(facts, op=dist.ReduceOp.MIN, group=self._group)
        if int(facts[1]) != -int(facts[2]):
            raise ValueError(
                f"ranks yielded different numbers of batches in one window ({int(facts[1])} to {-int(facts[2])}); "
                "AllHotBatches needs the same number of batches on every rank"
            )
        return int(facts[0])


def spread(count: int, slots: int) -> list[int]:
    """``count`` positions out of ``range(slots)``, evenly spaced (the same on every rank)."""
    return [((2 * j + 1) * slots) // (2 * count) for j in range(count)]


def fillable_batches(sizes: list[int], hot_samples: int) -> int:
    """The most all-hot batches (at :func:`spread` positions) that ``hot_samples`` can fill."""
    for count in range(len(sizes), 0, -1):
        if sum(sizes[p] for p in spread(count, len(sizes))) <= hot_samples:
            return count
    return 0


def take_samples(batches: list[Batch], index: torch.Tensor) -> Batch:
    """One ``Batch`` of the samples ``index`` of ``batches`` laid end to end."""
    dense = torch.cat([b.dense_features for b in batches]).index_select(0, index)
    labels = torch.cat([b.labels for b in batches]).index_select(0, index)
    return Batch(
        dense_features=dense, sparse_features=take_kjt([b.sparse_features for b in batches], index), labels=labels
    )


def take_kjt(kjts: list[KeyedJaggedTensor], index: torch.Tensor) -> KeyedJaggedTensor:
    """The samples ``index`` of ``kjts`` laid end to end, every key kept."""
    keys = kjts[0].keys()
    for kjt in kjts:
        if kjt.keys() != keys:
            raise ValueError(f"batches have different sparse features: {keys} and {kjt.keys()}")
        if kjt.variable_stride_per_key():
            raise ValueError("AllHotBatches needs one batch size for every feature")
    weighted = kjts[0].weights_or_none() is not None
    lengths, values, weights = [], [], []
    for key in keys:
        jts = [kjt[key] for kjt in kjts]
        key_lengths = torch.cat([jt.lengths() for jt in jts])
        starts = torch.cumsum(key_lengths, 0) - key_lengths
        chosen = key_lengths.index_select(0, index)
        first = starts.index_select(0, index)
        within = torch.arange(int(chosen.sum()), device=chosen.device) - torch.repeat_interleave(
            torch.cumsum(chosen, 0) - chosen, chosen
        )
        positions = torch.repeat_interleave(first, chosen) + within
        lengths.append(chosen)
        values.append(torch.cat([jt.values() for jt in jts]).index_select(0, positions))
        if weighted:
            weights.append(torch.cat([jt.weights() for jt in jts]).index_select(0, positions))
    return KeyedJaggedTensor(
        keys=keys,
        values=torch.cat(values),
        lengths=torch.cat(lengths),
        weights=torch.cat(weights) if weighted else None,
        stride=index.numel(),
    )


def read_here_of(model: torch.nn.Module) -> Classifier:
    """The hot-sample test of every row-replicated module in ``model`` (all must pass).

    Raises:
        ValueError: the model has no module with ``het_row_replicated`` tables.
    """
    modules = [m for m in model.modules() if hasattr(m, "samples_read_here") and m.replicated_lookups()]
    if not modules:
        raise ValueError("the model has no module with het_row_replicated tables; nothing to group by")

    def read_here(features: KeyedJaggedTensor) -> torch.Tensor:
        here = torch.ones(features.stride(), dtype=torch.bool, device=features.device())
        for module in modules:
            here &= module.samples_read_here(features).to(here.device)
        return here

    return read_here
