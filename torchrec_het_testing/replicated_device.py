"""The plugin's types on one device, world size 1, against the unsharded model (tests/gpu).

One body serves every device: :func:`world_size_one` shards small models with the
plugin's sharders on ``device`` (a CUDA device with NCCL, or the CPU with gloo), trains
them a few steps with a fused optimizer and returns their largest relative distance from
the unsharded model trained on the same batches. The CUDA run proves no buffer or kernel
of the plugin is tied to the CPU; the CPU run of the same body proves the body itself.

Cases:
    ``het_cached_row_wise/s0``: every table of an EBC (widths 8 and 4, sum and mean
    pooling, a table read by two features) cached at s_read = s_write = 0 (exact).
    ``het_row_replicated/bags``: the same EBC, its 8 hottest rows per table replicated.
    ``het_row_replicated/sequences``: two EmbeddingCollections (widths 8 and 4, one table
    read by two features), 8 hot rows per table replicated.
    ``.../bags_per_host``, ``.../sequences_per_host``: the same with a per-host tier of 3 rows
    per table too, which takes the earlier (unstaged) lookups and their replica kernels.
"""

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from torchrec_het_bench.table_init import init_tables_by_row
from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharders import HetEmbeddingBagCollectionSharder
from torchrec_het.sharding import het_cached_row_wise
from torchrec_het_testing import replicated_sequence_ranks as sequences
from torchrec_het_testing.het_ranks import (
    SEED,
    STEPS,
    _ebc,
    _local_shard_errors,
    _pooling,
    _rel_error,
    _worst,
    batch,
    loss_of,
    projections,
    table_configs,
)
from torchrec_het_testing.replicated_ranks import replicated, shard_ebc, tiers

CASES = (
    "het_cached_row_wise/s0",
    "het_row_replicated/bags",
    "het_row_replicated/sequences",
    "het_row_replicated/bags_per_host",
    "het_row_replicated/sequences_per_host",
)
DEVICE_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")
HOT = 8
PER_HOST = 3


@contextmanager
def one_rank_group(device: torch.device, store_dir: str | Path | None = None) -> Iterator[None]:
    """A world-size-1 process group in this process for the block: NCCL on CUDA, gloo on the CPU,
    met through a FileStore in ``store_dir`` (a temporary folder if None)."""
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialized in this process")
    with tempfile.TemporaryDirectory(dir=store_dir) as folder:
        store = dist.FileStore(str(Path(folder, "store")), 1)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
        else:
            dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _bag_model(kind: str, configs, optimizer: str, device: torch.device, per_host: int = 0):
    """The EBC with every table ``kind``, sharded on ``device`` by the plugin's bag sharder, weights set."""
    if kind == "het_row_replicated":
        replication = ReplicationConfig(tiers=tiers(configs, hot=HOT, per_host=per_host))
        return replicated(configs, False, optimizer, replication, device=str(device))
    exact = HetCacheConfig(default=CacheSettings(s_read=0, s_write=0))
    sharder = HetEmbeddingBagCollectionSharder(cache=exact)
    return shard_ebc(_ebc(configs, False, optimizer, "meta"), configs, sharder, het_cached_row_wise, SEED, str(device))


def bag_errors(kind: str, optimizer: str, device: torch.device, per_host: int = 0) -> dict[str, float]:
    """Largest relative differences from the unsharded EBC over STEPS steps: ``out/<pooling>``
    every step, ``weights/<pooling>`` at the end; ``replica_syncs`` for het_row_replicated."""
    configs = table_configs(weighted=False)
    proj = {f: p.to(device) for f, p in projections(configs).items()}
    model = _bag_model(kind, configs, optimizer, device, per_host)
    reference = _ebc(configs, False, optimizer, device.type)
    init_tables_by_row(reference, configs, SEED)
    pooling = {f: _pooling(c) for c in configs for f in c.feature_names}
    errors: dict[str, float] = {}
    for step in range(STEPS):
        features = batch(0, step, False, configs).to(device)
        out, want = model(features), reference(features)
        for f in proj:
            _worst(errors, f"out/{pooling[f]}", _rel_error(out[f], want[f]))
        loss_of(out, proj).backward()
        loss_of(want, proj).backward()
    _local_shard_errors(model, reference, configs, errors, "weights")
    if kind == "het_row_replicated":
        errors["replica_syncs"] = _syncs(model.module.replication_stats())
    return errors


def _syncs(stats: dict[str, int]) -> int:
    """Replica syncs applied: one a step when hot rows were read and replicated."""
    return stats["sparse_syncs"] + stats["dense_syncs"]


def sequence_errors(optimizer: str, device: torch.device, per_host: int = 0) -> dict[str, float]:
    """Largest relative differences from the unsharded ECs over STEPS steps (``out_rep_vs_unsharded``,
    ``weights_rep_vs_unsharded``), and ``replica_syncs``."""
    configs = sequences.table_configs()
    proj = {f: p.to(device) for f, p in sequences.projections(configs).items()}
    replication = ReplicationConfig(tiers=tiers(sequences.all_configs(configs), hot=HOT, per_host=per_host))
    model = sequences.sharded("rep", configs, optimizer, replication, device=str(device))
    reference = sequences.unsharded(configs, optimizer, device=str(device))
    errors: dict[str, float] = {}
    batches_of = lambda rank, step: sequences.batch(rank, step, configs)  # noqa: E731
    sequences.train_against_unsharded(model, reference, proj, batches_of, 0, 1, errors, device)
    sequences._local_shard_errors(model, reference, errors, "weights_rep_vs_unsharded")
    errors["replica_syncs"] = _syncs(sequences.stats(model))
    return errors


def case_errors(case: str, optimizer: str, device: torch.device) -> dict[str, float]:
    """One case of :data:`CASES` (a process group of world size 1 must be up)."""
    kind, what = case.split("/")
    per_host = PER_HOST if what.endswith("_per_host") else 0
    if what.startswith("sequences"):
        return sequence_errors(optimizer, device, per_host)
    return bag_errors(kind, optimizer, device, per_host)


def world_size_one(device: torch.device, cases=CASES, optimizers=DEVICE_OPTIMIZERS, store_dir=None) -> dict:
    """``{case/optimizer: errors}`` for every case and optimizer, in one world-size-1 group on ``device``."""
    device = torch.device(device)
    with one_rank_group(device, store_dir):
        return {f"{case}/{opt}": case_errors(case, opt, device) for case in cases for opt in optimizers}
