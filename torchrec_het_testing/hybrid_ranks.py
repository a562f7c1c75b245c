"""Rank bodies of tests/distributed/test_hybrid_pipeline.py: :class:`~torchrec_het.pipeline.HybridTrainPipeline`
against TorchRec's ``TrainPipelineSparseDist`` (that k = 0 trains as the unsharded model, and
replicas synced every step as stock row_wise under every k, is checked by the generic tests,
:mod:`~torchrec_het_testing.equivalence`).

The model is an EmbeddingBagCollection (stock table_wise and row_wise, ``het_cached_row_wise``
at s = 0, ``het_row_replicated`` with hot rows synced every step) under a small dense layer
that DDP trains, so both halves of the hybrid are exercised.

``stale``
    k = 1 and 2: the staleness gauge's largest value is k (and never more), the run is
    finite, and gradient mass is conserved: with fused SGD (sum pooling, no weights), the
    total change of each table equals ``-lr * scale`` times the gradient that reached the
    pooled embeddings, summed over ranks and trained batches. ``model.state_dict()`` is taken
    right after the last ``progress``, while its embedding update may still be on the worker,
    so the check also shows the drain; ``TrainPipelineSparseDist`` is the control.
``errors``
    k < 0 and a model with no sharded embedding module raise ValueError.
"""

import torch
import torch.distributed as dist
from torchrec.datasets.utils import Batch
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.model_parallel import DistributedModelParallel, get_unwrapped_module
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het.pipeline import HybridTrainPipeline
from torchrec_het.pipeline.hybrid import PROBE_STEPS, SYNC_FIRST
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.sharders import CpuRowWiseEmbeddingBagCollectionSharder, HetEmbeddingBagCollectionSharder
from torchrec_het.sharding import het_cached_row_wise, het_row_replicated
from torchrec_het_testing.bag_models import batch, ebc_with_optimizer
from torchrec_het_testing.settings import hot_rows
from torchrec_het_testing.spawn import gloo_rank, write_rank_result
from torchrec_het_testing.weights import full_tables, seeded_tables, set_tables

SEED = 5
STEPS = 7
PROBED_STEPS = SYNC_FIRST + 2 * PROBE_STEPS + 3  # a few steps past the measured choice
LR = 0.1
TABLES = [("t0", ["f0"], 8, 50), ("t1", ["f1", "f2"], 4, 37), ("t2", ["f3"], 8, 61)]
KINDS = ("table_wise", "row_wise", "het", "replicated")


def _configs() -> list[EmbeddingBagConfig]:
    return [EmbeddingBagConfig(name=n, feature_names=f, embedding_dim=d, num_embeddings=r) for n, f, d, r in TABLES]


class DenseOnTop(torch.nn.Module):
    """An EBC, one linear layer over its pooled embeddings and a squared loss: (loss, loss) per batch."""

    def __init__(self, ebc, configs) -> None:
        super().__init__()
        self.ebc = ebc
        self.features = [f for c in configs for f in c.feature_names]
        width = sum(c.embedding_dim * len(c.feature_names) for c in configs)
        self.dense = torch.nn.Linear(width, 1)
        with torch.no_grad():
            generator = torch.Generator().manual_seed(SEED)
            self.dense.weight.copy_(torch.randn(1, width, generator=generator) * 0.3)
            self.dense.bias.fill_(0.1)
        self.seen: list | None = None  # gradients reaching the pooled embeddings, batch by batch, when recorded
        self.dense.register_forward_pre_hook(self._record)  # a module hook: the model stays fx-traceable

    def _record(self, module, inputs) -> None:  # noqa: ARG002
        if self.seen is not None and inputs[0].requires_grad:
            index = len(self.seen)
            self.seen.append(None)
            inputs[0].register_hook(lambda g: self.seen.__setitem__(index, g.detach().clone()))

    def forward(self, features):
        pooled = self.ebc(features)
        values = torch.cat([pooled[f] for f in self.features], 1)  # the tables' order, whatever the sharding's
        loss = ((self.dense(values) - 1.0) ** 2).sum()
        return loss, loss.detach()


def _model(kind: str, configs, optimizer: str = "sgd"):
    ebc = ebc_with_optimizer(configs, False, optimizer, "meta", LR)
    if kind in ("het", "replicated"):
        cache = HetCacheConfig(default=CacheSettings(s_read=0, s_write=0, capacity=0.3))
        replication = ReplicationConfig(tiers=hot_rows(configs, 6)) if kind == "replicated" else None
        sharder = HetEmbeddingBagCollectionSharder(cache=cache, replication=replication)
        generator = het_cached_row_wise if kind == "het" else het_row_replicated
    else:
        sharder = CpuRowWiseEmbeddingBagCollectionSharder()
        generator = row_wise if kind == "row_wise" else (lambda: table_wise(rank=0))
    per_table = {}
    for i, c in enumerate(configs):
        per_table[c.name] = table_wise(rank=i % dist.get_world_size()) if kind == "table_wise" else generator()
    plan = construct_module_sharding_plan(
        ebc, per_param_sharding=per_table, world_size=dist.get_world_size(), device_type="cpu", sharder=sharder
    )
    model = DistributedModelParallel(
        DenseOnTop(ebc, configs), device=torch.device("cpu"), plan=ShardingPlan({"ebc": plan}), sharders=[sharder]
    )
    set_tables(model, seeded_tables(configs, SEED))
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())), lambda params: torch.optim.SGD(params, lr=LR)
    )
    return model, CombinedOptimizer([model.fused_optimizer, dense])


def _tables(model, configs) -> dict[str, torch.Tensor]:
    """Every table whole (all ranks' shards) and the dense layer's weights."""
    out = full_tables(model, configs)  # state_dict(): drains the update in flight first
    out.update({name: p.detach().clone() for name, p in get_unwrapped_module(model).dense.named_parameters()})
    return out


def _train(kind: str, configs, pipeline_of, optimizer: str = "sgd", record: bool = False, steps: int = STEPS):
    rank = dist.get_rank()
    model, opt = _model(kind, configs, optimizer)
    model.module.seen = [] if record else None
    pipeline = pipeline_of(model, opt)
    batches = iter([batch(rank, step, False, configs) for step in range(steps)])
    losses = []
    for _ in range(steps):
        losses.append(float(pipeline.progress(batches)))
    return model, pipeline, losses


def _max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _mass(seen: list, configs) -> dict[str, torch.Tensor]:
    """Per table: the gradient its rows received in total (sum pooling: each id gets its bag's gradient)."""
    mass = {c.name: torch.zeros(c.embedding_dim) for c in configs}
    for step, grad in enumerate(seen):
        lengths = batch(dist.get_rank(), step, False, configs).lengths().view(-1, grad.size(0))
        column, feature = 0, 0
        for c in configs:
            for _ in c.feature_names:
                block = grad[:, column : column + c.embedding_dim]
                mass[c.name] += (lengths[feature].unsqueeze(1).to(block.dtype) * block).sum(0)
                column += c.embedding_dim
                feature += 1
    for m in mass.values():
        dist.all_reduce(m)
    return mass


def stale(world_size: int) -> dict:
    """k = 1, 2: the gauge, and gradient mass conserved (the last update drained by state_dict)."""
    configs = _configs()
    scale = 1.0 / world_size if get_gradient_division() else 1.0  # TorchRec's embedding gradient division
    out = {}
    for kind in KINDS:
        for k in (None, 1, 2):
            if k is None:
                make = lambda m, o: TrainPipelineSparseDist(m, o, torch.device("cpu"))  # noqa: E731
            else:
                make = lambda m, o, k=k: HybridTrainPipeline(  # noqa: E731
                    m, o, torch.device("cpu"), embedding_staleness=k, backward_on_worker=True
                )
            initial, _ = _model(kind, configs)
            before = _tables(initial, configs)
            model, pipeline, losses = _train(kind, configs, make, record=True)
            after = _tables(model, configs)  # state_dict drains the update still in flight
            mass = _mass(model.module.seen, configs)
            errors = []
            for c in configs:
                change = (after[c.name] - before[c.name]).sum(0)
                want = -LR * scale * mass[c.name]
                errors.append(float((change - want).abs().max() / want.abs().max().clamp(min=1e-6)))
            label = f"{kind}/{'sparse_dist' if k is None else f'k{k}'}"
            out[label] = {
                "mass_error": max(errors),
                "batches": len(model.module.seen),
                "finite": all(loss == loss and abs(loss) < 1e9 for loss in losses),
                "gauge": pipeline.gauge.as_dict() if k is not None else None,
            }
    return out


def placement(world_size: int) -> dict:
    """k = 2 with the embedding backward on the main thread, on the worker, and measured (None):
    the same weights (where it runs changes no arithmetic), and the measured run chooses one way."""
    configs = _configs()
    out = {}
    for kind in ("row_wise", "het"):
        runs = {}
        for on_worker in (True, False, None):
            make = lambda m, o, w=on_worker: HybridTrainPipeline(  # noqa: E731
                m, o, torch.device("cpu"), embedding_staleness=2, backward_on_worker=w
            )
            model, pipeline, losses = _train(kind, configs, make, steps=PROBED_STEPS)
            runs[on_worker] = (_tables(model, configs), pipeline.backward_on_worker_chosen)
        out[kind] = {
            "inline_vs_worker": _max_diff(runs[False][0], runs[True][0]),
            "measured_vs_worker": _max_diff(runs[None][0], runs[True][0]),
            "chosen": runs[None][1],
        }
    return out


def errors(world_size: int) -> dict:
    """Bad settings: a clear ValueError each."""
    out = {}
    model, opt = _model("row_wise", _configs())
    for bad in (-1, 1.5, True):
        try:
            HybridTrainPipeline(model, opt, torch.device("cpu"), embedding_staleness=bad)
            out[f"k={bad}"] = "no error"
        except ValueError as error:
            out[f"k={bad}"] = str(error)
    try:
        HybridTrainPipeline(model, opt, torch.device("cpu"), embedding_staleness=1, backward_on_worker="yes")
        out["backward_on_worker"] = "no error"
    except ValueError as error:
        out["backward_on_worker"] = str(error)
    dense = torch.nn.Linear(3, 1)
    plain = DistributedModelParallel(_NoEmbeddings(dense), device=torch.device("cpu"))
    pipeline = HybridTrainPipeline(
        plain, torch.optim.SGD(plain.parameters(), lr=0.1), torch.device("cpu"), embedding_staleness=1
    )
    try:
        empty = KeyedJaggedTensor.from_lengths_sync(
            keys=["f0"], values=torch.zeros(0, dtype=torch.int64), lengths=torch.zeros(2, dtype=torch.int64)
        )
        pipeline.progress(iter([Batch(torch.ones(2, 3), empty, torch.ones(2)) for _ in range(4)]))
        out["no_embeddings"] = "no error"
    except ValueError as error:
        out["no_embeddings"] = str(error)
    return out


class _NoEmbeddings(torch.nn.Module):
    def __init__(self, dense) -> None:
        super().__init__()
        self.dense = dense

    def forward(self, batch):
        loss = self.dense(batch.dense_features).sum()
        return loss, loss.detach()


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Spawn target: every check of this module."""
    with gloo_rank(rank, world_size, port, timeout_s=120):
        result = {"stale": stale(world_size), "placement": placement(world_size), "errors": errors(world_size)}
    write_rank_result(out_dir, rank, result)
