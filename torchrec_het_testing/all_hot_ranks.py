"""Rank bodies of tests/distributed/test_all_hot_batches.py.

FAE's loader wrapper (:class:`~torchrec_het.replication.all_hot.AllHotBatches`) on a
``het_row_replicated`` EmbeddingBagCollection: windows come back as permutations of
their samples, all-hot batches sit at the same steps on every rank, those steps skip
the cold exchange, and training on the regrouped stream equals the unsharded model.
"""

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.replication.all_hot import AllHotBatches, read_here_of
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het_testing.bag_models import batch, loss_of, projections, replicated, table_configs, unsharded
from torchrec_het_testing.settings import hot_rows
from torchrec_het_testing.spawn import gloo_rank, write_rank_result
from torchrec_het_testing.weights import full_tables, relative_error

HOT = 12  # replicated rows per table: 0..11
WINDOW = 8
BATCHES = 12  # one full window and a partial one


def stream(rank: int, configs, count: int = BATCHES, hot_share: float = 0.6) -> list[Batch]:
    """Batches whose samples are made all-hot (ids mod HOT) with probability ``hot_share``;
    a sample's label is its global number, so regrouped batches can be traced back."""
    generator = torch.Generator().manual_seed(500 + rank)
    out = []
    for step in range(count):
        kjt = batch(rank, step, False, configs)
        size = kjt.stride()
        forced = torch.rand(size, generator=generator) < hot_share
        per_key = kjt.to_dict()
        values = []
        for key in kjt.keys():
            jt = per_key[key]
            sample = torch.repeat_interleave(torch.arange(size), jt.lengths().long())
            values.append(torch.where(forced[sample], jt.values() % HOT, jt.values()))
        sparse = KeyedJaggedTensor(keys=kjt.keys(), values=torch.cat(values), lengths=kjt.lengths(), stride=size)
        first = (rank * count + step) * size
        labels = torch.arange(first, first + size, dtype=torch.float32)
        out.append(Batch(dense_features=labels.unsqueeze(1), sparse_features=sparse, labels=labels))
    return out


def _sample_signatures(batches: list[Batch]) -> dict[int, list[tuple]]:
    """Per sample (by label): its dense value and its ids per key."""
    out = {}
    for b in batches:
        per_key = b.sparse_features.to_dict()
        for i, label in enumerate(b.labels.long().tolist()):
            ids = []
            for key in b.sparse_features.keys():
                offsets = per_key[key].offsets()
                ids.append(tuple(per_key[key].values()[offsets[i] : offsets[i + 1]].tolist()))
            out[label] = [float(b.dense_features[i, 0])] + ids
    return out


def regrouping(rank: int, world_size: int, optimizer: str = "rowwise_adagrad") -> dict:
    configs = table_configs(False)
    proj = projections(configs)
    rep = replicated(configs, False, optimizer, ReplicationConfig(tiers=hot_rows(configs, HOT)))
    reference = unsharded(configs, False, optimizer)
    original = stream(rank, configs)
    wrapper = AllHotBatches(original, read_here_of(rep), window=WINDOW)
    regrouped = list(wrapper)
    result: dict = {"stats": dict(wrapper.stats)}
    result["sizes_kept"] = [int(b.labels.numel()) for b in regrouped] == [int(b.labels.numel()) for b in original]
    result["same_samples_per_window"] = all(
        _sample_signatures(original[w : w + WINDOW]) == _sample_signatures(regrouped[w : w + WINDOW])
        for w in range(0, BATCHES, WINDOW)
    )
    result["all_read_here"] = [bool(rep.module.samples_read_here(b.sparse_features).all()) for b in regrouped]
    everyone = [None] * world_size
    dist.all_gather_object(everyone, [(b.sparse_features.values(), b.sparse_features.lengths()) for b in regrouped])
    rep.module.reset_replication_stats()
    worst_out = 0.0
    for step in range(len(regrouped)):
        kjts = [
            KeyedJaggedTensor(keys=regrouped[0].sparse_features.keys(), values=v, lengths=n)
            for v, n in (everyone[r][step] for r in range(world_size))
        ]
        out = rep(regrouped[step].sparse_features)
        ref_outs = [reference(k) for k in kjts]
        worst_out = max([worst_out] + [relative_error(out[f], ref_outs[rank][f]) for f in proj])
        loss_of(out, proj).backward()
        (sum(loss_of(o, proj) for o in ref_outs) / world_size).backward()
    tables = full_tables(rep, configs)
    weights = max(relative_error(tables[c.name], reference.embedding_bags[c.name].weight) for c in configs)
    result["errors"] = {"out_rep_vs_unsharded": worst_out, "weights_rep_vs_unsharded": weights}
    result["replication"] = rep.module.replication_stats()
    return result


def uneven_streams(rank: int, world_size: int) -> str:
    """Rank 0 yields more batches than the others: every rank gets the same clear error."""
    configs = table_configs(False)
    rep = replicated(configs, False, "sgd", ReplicationConfig(tiers=hot_rows(configs, HOT)))
    batches = stream(rank, configs, count=8 if rank == 0 else 5)
    try:
        list(AllHotBatches(batches, read_here_of(rep), window=4))
    except ValueError as error:
        return str(error)
    return ""


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    with gloo_rank(rank, world_size, port, timeout_s=120):
        results = {"regrouping": regrouping(rank, world_size), "uneven": uneven_streams(rank, world_size)}
    write_rank_result(out_dir, rank, results)
