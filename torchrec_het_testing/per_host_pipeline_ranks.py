"""Rank bodies of tests/distributed/test_row_replicated_per_host.py.

``het_row_replicated`` with both hot tiers (replicated rows and per-host rows) on 4 ranks as
2 hosts x 2, bags (EmbeddingBagCollection) and sequences (EmbeddingCollection):

``*/sparse_dist``
    under TorchRec's ``TrainPipelineSparseDist``, against the unsharded module trained on the
    global batches (stock row_wise under the same pipeline beside it, its own drift recorded).
``*/hybrid_k2``
    under the hybrid pipeline at k = 2 (embeddings looked up two steps ahead), against stock
    row_wise under the same pipeline: the unsharded module has no such lag, row_wise has it
    exactly, so every row of a batch must be read at its lookup and every update applied
    when row_wise applies it.
``*/plain``
    a plain loop (sequences), against the unsharded EC.

Each run also reports how far every replica copy is from its owner's row and how many
per-host rows this rank holds away from their owners.
"""

from types import SimpleNamespace

import torch
import torch.distributed as dist
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import LazyAwaitable, ShardingPlan
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.pipeline import HybridTrainPipeline
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharders import HetEmbeddingCollectionSharder
from torchrec_het.sharding import het_row_replicated
from torchrec_het_bench.table_init import init_tables_by_row
from torchrec_het_testing import het_ranks, replicated_sequence_ranks as sequences
from torchrec_het_testing.het_ranks import OPTIMIZERS
from torchrec_het_testing.pipeline_ranks import pipeline_model, under_pipeline
from torchrec_het_testing.replicated_ranks import per_host_held, replica_disagreement, tiers
from torchrec_het_testing.spawn import gloo_rank, write_rank_result

STEPS = 6
LOCAL_WORLD_SIZE = 2


def per_host_config(configs) -> ReplicationConfig:
    """Rows 0, 3, ..., 9 replicated, the next 12 of that stride per host (their owners spread over all ranks)."""
    return ReplicationConfig(tiers=tiers(configs, hot=4, per_host=12, stride=3), local_world_size=LOCAL_WORLD_SIZE)


def full_tables(model, names: list[str]) -> dict[str, torch.Tensor]:
    """Every table of ``names``, its local shards summed into place over ranks (a collective)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        table = key.split(".")[-2]
        if table not in names or not hasattr(value, "local_shards"):
            continue
        full = out.setdefault(table, torch.zeros(value.size()))
        for shard in value.local_shards():
            (r, c), (n, m) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            full[r : r + n, c : c + m] += shard.tensor.detach()
    for name in sorted(out):
        dist.all_reduce(out[name])
    return out


def run_pipeline(model, pipeline, batches: list) -> list[float]:
    """Losses of ``batches`` trained by ``pipeline``."""
    iterator = iter(batches)
    return [float(pipeline.progress(iterator)) for _ in batches]


def _relative(got: dict, want: dict) -> float:
    return max(float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp(min=1e-6)) for k in want)


def _loss_error(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / max(abs(b), 1e-6) for a, b in zip(got, want))


def hybrid(world_size: int, pipelines: dict, names: list[str]) -> dict:  # noqa: ARG001
    """``pipelines``: kind -> (model, pipeline, batches) of ``replicated`` and ``row_wise``: both trained
    at k = 2; the replicated run against row_wise's losses and tables."""
    runs = {kind: (run_pipeline(model, pipeline, batches), model) for kind, (model, pipeline, batches) in pipelines.items()}
    tables = {kind: full_tables(model, names) for kind, (_, model) in runs.items()}
    model = runs["replicated"][1]
    return {
        "loss/replicated_vs_row_wise": _loss_error(runs["replicated"][0], runs["row_wise"][0]),
        "weights/replicated_vs_row_wise": _relative(tables["replicated"], tables["row_wise"]),
        "replica_disagreement": replica_disagreement(SimpleNamespace(module=_sharded_module(model))),
        "per_host_held": sum(per_host_held(lookup) for lookup in _sharded_module(model).replicated_lookups()),
        "stats": _sharded_module(model).replication_stats(),
    }


def _sharded_module(model):
    """The sharded embedding module of a pipelined test model (``ebc`` or ``ec``)."""
    inner = model.module
    return inner.ebc if hasattr(inner, "ebc") else inner.ec


def _hybrid_pipeline(model):
    return HybridTrainPipeline(
        model, CombinedOptimizer([model.fused_optimizer]), torch.device("cpu"), embedding_staleness=2, backward_on_worker=True
    )


def bags(rank: int, world_size: int) -> dict:
    """Bags: TrainPipelineSparseDist against unsharded (weighted and not), hybrid k = 2 against row_wise."""
    results = {}
    for weighted in (False, True):
        configs = het_ranks.table_configs(weighted)
        label = "weighted" if weighted else "unweighted"
        result = under_pipeline(rank, world_size, "rowwise_adagrad", weighted, per_host_config(configs))
        results[f"bags/{label}/sparse_dist"] = result
    configs = het_ranks.table_configs(False)
    batches = [het_ranks.batch(rank, step, False, configs) for step in range(STEPS)]
    pipelines = {}
    for kind in ("replicated", "row_wise"):
        model = pipeline_model(kind, configs, False, "rowwise_adagrad", per_host_config(configs) if kind == "replicated" else None)
        pipelines[kind] = (model, _hybrid_pipeline(model), batches)
    result = hybrid(world_size, pipelines, [c.name for c in configs])
    result["per_host_held"] = sum(per_host_held(lookup) for lookup in pipelines["replicated"][0].module.ebc.replicated_lookups())
    results["bags/hybrid_k2"] = result
    return results


class SequenceLoss(torch.nn.Module):
    """An EC and the test loss, returning (loss, loss) as TorchRec's train pipelines expect."""

    def __init__(self, ec: EmbeddingCollection, proj: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.ec, self.proj = ec, proj

    def forward(self, features: KeyedJaggedTensor):
        out = self.ec(features)
        if isinstance(out, LazyAwaitable):
            out = out.wait()
        loss = sequences.loss_of(out, self.proj)
        return loss, loss.detach()


def _sequence_configs():
    return sequences.table_configs()["ec8"]  # one width: t0 (50 rows), t2 (101 rows)


def sequence_model(kind: str, optimizer: str, sharded: bool = True):
    """The dim-8 EC under the test loss: ``replicated`` (both tiers), stock ``row_wise``, or unsharded."""
    configs = _sequence_configs()
    proj = {f: p for f, p in sequences.projections(sequences.table_configs()).items() if f in {"f0", "f3"}}
    ec = EmbeddingCollection(configs, device=torch.device("meta" if sharded else "cpu"))
    cls, kwargs = OPTIMIZERS[optimizer]
    apply_optimizer_in_backward(cls, ec.parameters(), dict(kwargs))
    model = SequenceLoss(ec, proj)
    if not sharded:
        init_tables_by_row(model, configs, het_ranks.SEED)
        return model
    if kind == "replicated":
        sharder, generator = HetEmbeddingCollectionSharder(replication=per_host_config(configs)), het_row_replicated
    else:
        sharder, generator = EmbeddingCollectionSharder(), row_wise
    plan = construct_module_sharding_plan(
        ec, per_param_sharding={c.name: generator() for c in configs}, world_size=dist.get_world_size(),
        device_type="cpu", sharder=sharder,
    )
    model = DistributedModelParallel(model, device=torch.device("cpu"), plan=ShardingPlan({"ec": plan}), sharders=[sharder])
    init_tables_by_row(model, configs, het_ranks.SEED)
    return model


def _sequence_batch(rank: int, step: int) -> KeyedJaggedTensor:
    return sequences.batch(rank, step, sequences.table_configs())["ec8"]


def _unsharded_run(world_size: int, rank: int, optimizer: str) -> tuple[list[float], dict]:
    """The unsharded EC trained on every rank's batches (their mean loss): this rank's losses, the tables."""
    reference = sequence_model("unsharded", optimizer, sharded=False)
    losses = []
    for step in range(STEPS):
        per_rank = [reference(_sequence_batch(r, step))[0] for r in range(world_size)]
        losses.append(float(per_rank[rank]))
        (sum(per_rank) / world_size).backward()
    return losses, {c.name: reference.ec.embeddings[c.name].weight.detach() for c in _sequence_configs()}


def sequence_runs(rank: int, world_size: int, optimizer: str = "rowwise_adagrad") -> dict:
    """Sequences: a plain loop and TrainPipelineSparseDist against unsharded, hybrid k = 2 against row_wise."""
    names = [c.name for c in _sequence_configs()]
    batches = [_sequence_batch(rank, step) for step in range(STEPS)]
    want_losses, want_tables = _unsharded_run(world_size, rank, optimizer)
    results = {}
    for how in ("plain", "sparse_dist"):
        result = {}
        for kind in ("replicated", "row_wise"):
            model = sequence_model(kind, optimizer)
            if how == "plain":
                losses = []
                for features in batches:
                    loss, _ = model(features)
                    loss.backward()
                    losses.append(float(loss))
            else:
                pipeline = TrainPipelineSparseDist(model, CombinedOptimizer([model.fused_optimizer]), torch.device("cpu"))
                losses = run_pipeline(model, pipeline, batches)
            result[f"loss/{kind}"] = _loss_error(losses, want_losses)
            result[f"weights/{kind}"] = _relative(full_tables(model, names), want_tables)
            if kind == "replicated":
                result["replica_disagreement"] = replica_disagreement(SimpleNamespace(module=model.module.ec))
                result["per_host_held"] = sum(per_host_held(lookup) for lookup in model.module.ec.replicated_lookups())
                result["stats"] = model.module.ec.replication_stats()
        results[f"sequences/{how}"] = result
    pipelines = {}
    for kind in ("replicated", "row_wise"):
        model = sequence_model(kind, optimizer)
        pipelines[kind] = (model, _hybrid_pipeline(model), batches)
    results["sequences/hybrid_k2"] = hybrid(world_size, pipelines, names)
    return results


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Spawn target (4 ranks): bags and sequences, every pipeline; writes ``rank<r>.json``."""
    with gloo_rank(rank, world_size, port, timeout_s=180):
        results = {**bags(rank, world_size), **sequence_runs(rank, world_size)}
    write_rank_result(out_dir, rank, results)
