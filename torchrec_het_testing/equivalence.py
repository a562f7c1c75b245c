"""One sharded-against-unsharded body for every sharding type, in the spirit of TorchRec's
``sharding_single_rank_test`` (torchrec/distributed/test_utils/test_sharding.py).

Each rank builds the unsharded model (:class:`~torchrec_het_testing.models.SparseDenseModel`,
seeded) and the same model on the meta device, plans it with the plugin's planner constrained
to the case's sharding type, shards it with the plugin's sharders and
``DistributedModelParallel``, and copies the unsharded weights into it. It trains the sharded
model on its own batches under the case's pipeline, and the unsharded model on every rank's
batches (their mean loss: TorchRec averages gradients over ranks), with the same fused
optimizer on the tables and SGD on the dense layer. It records the largest relative
differences of the predictions of every step, of every table (all shards gathered) and of the
dense layer at the end, and of the predictions of one more batch, in evaluation, that reads
every row (a replica or a cached copy that disagrees with its owner shows there). A case whose
pipeline is stale by design (hybrid k >= 1) is compared with a model stale the same way: the
same model planned stock ``row_wise`` under the same pipeline; so is a case with TorchRec's quantized
comms (``qcomms``): exact under a codec means what stock ``row_wise`` gives under the same codec,
within the codec's rounding (docs/internals.md#quantized-comms).

Only public entry points are used (the planner, the sharders, ``DistributedModelParallel``, the
pipelines, ``torchrec_het.stats_by_table``), so the body does not depend on how a type is built;
but for one look inside: every replica of a ``het_row_replicated`` model is compared with its
owner's row at the end (:func:`~torchrec_het_testing.replica_state.replica_disagreement`, the
one module that knows the lookups' insides).
"""

import traceback
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.model_parallel import DistributedModelParallel, get_unwrapped_module
from torchrec.distributed.planner import ParameterConstraints, Topology
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

import torchrec_het
from torchrec_het.config import CacheSettings
from torchrec_het.pipeline import HybridTrainPipeline
from torchrec_het.planner import HetEmbeddingShardingPlanner
from torchrec_het.replication.profile import AccessProfile
from torchrec_het.types import HET_ROW_REPLICATED
from torchrec_het_testing.models import (
    TABLE_SETS,
    BatchSpec,
    ModelBatch,
    SparseDenseModel,
    every_row_batch,
    train_batch,
)
from torchrec_het_testing.replica_state import replica_disagreement
from torchrec_het_testing.settings import (
    OPTIMIZERS,
    ReplicaSettings,
    describe,
    het_sharders,
    plugin_pricing,
    profile_of,
)
from torchrec_het_testing.spawn import gloo_rank, write_rank_result
from torchrec_het_testing.weights import full_tables, relative_error, seeded_tables, set_tables

SEED = 3
DENSE_LR = 0.05
PIPELINES = ("plain", "sparse_dist", "hybrid_k0", "hybrid_k1", "hybrid_k2")
STALE_PIPELINES = ("hybrid_k1", "hybrid_k2")


@dataclass(frozen=True)
class EquivalenceCase:
    """One run of :func:`sharded_vs_unsharded`.

    Attributes:
        tables: a :data:`~torchrec_het_testing.models.TABLE_SETS` name.
        sharding_type: every table's type (but ``stock_tables``'), a plugin type or a stock one.
        settings: the type's settings: ``CacheSettings`` (het_cached_row_wise) or
            :class:`~torchrec_het_testing.settings.ReplicaSettings` (het_row_replicated).
        optimizer: the tables' fused optimizer, an :data:`~torchrec_het_testing.settings.OPTIMIZERS` name.
        pipeline: ``plain`` (forward, backward, step), ``sparse_dist`` (TrainPipelineSparseDist)
            or ``hybrid_k<k>`` (HybridTrainPipeline with embedding staleness k).
        world_size: ranks.
        local_world_size: ranks per host (None: one host).
        steps: training steps.
        hot_only: every id is folded into rows ``[0, settings.hot)``: batches that read replicated rows only.
        stock_tables: tables planned stock ``row_wise`` in the same modules.
        tolerance: the relative difference the test accepts.
        qcomms: TorchRec's quantized comms on every sharder, ``"<forward>/<backward>"``
            (``"fp16/bf16"``); the reference is then stock ``row_wise`` under the same codecs.
    """

    tables: str
    sharding_type: str
    settings: CacheSettings | ReplicaSettings | None = None
    optimizer: str = "rowwise_adagrad"
    pipeline: str = "plain"
    world_size: int = 2
    local_world_size: int | None = None
    steps: int = 5
    hot_only: bool = False
    stock_tables: tuple[str, ...] = field(default=())
    tolerance: float = 1e-5
    qcomms: str | None = None

    def __post_init__(self) -> None:
        if self.tables not in TABLE_SETS:
            raise ValueError(f"unknown table set {self.tables!r}; expected one of {sorted(TABLE_SETS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; expected one of {sorted(OPTIMIZERS)}")
        if self.pipeline not in PIPELINES:
            raise ValueError(f"unknown pipeline {self.pipeline!r}; expected one of {PIPELINES}")
        if self.hot_only and not (isinstance(self.settings, ReplicaSettings) and self.settings.hot > 0):
            raise ValueError("hot_only needs ReplicaSettings with hot rows")

    @property
    def reference(self) -> str:
        """``unsharded``, or ``row_wise`` (the stock twin under the same pipeline) for a stale pipeline
        or under quantized comms (then with the same codecs)."""
        return "row_wise" if self.pipeline in STALE_PIPELINES or self.qcomms else "unsharded"

    @property
    def hosts(self) -> str:
        """``ws<ranks>`` on one host, ``<hosts>x<ranks per host>`` on several."""
        local = self.local_world_size or self.world_size
        return f"ws{self.world_size}" if local == self.world_size else f"{self.world_size // local}x{local}"

    @property
    def name(self) -> str:
        sharding = self.sharding_type + (f"+row_wise:{','.join(self.stock_tables)}" if self.stock_tables else "")
        qcomms = f"qcomms_{self.qcomms.replace('/', '_')}" if self.qcomms else ""
        parts = [self.hosts, self.tables, sharding, describe(self.settings), self.optimizer, self.pipeline,
                 "hot_only" * self.hot_only, qcomms]  # fmt: skip
        return "/".join(p for p in parts if p)


def optimizer_of(model: torch.nn.Module) -> torch.optim.Optimizer:
    """SGD on the dense parameters (the tables' optimizer runs in the backward); with the fused one
    of a sharded model, as TorchRec's test does."""
    dense = dict(in_backward_optimizer_filter(model.named_parameters()))
    if not isinstance(model, DistributedModelParallel):
        return torch.optim.SGD(dense.values(), lr=DENSE_LR)
    sgd = KeyedOptimizerWrapper(dense, lambda params: torch.optim.SGD(params, lr=DENSE_LR))
    return CombinedOptimizer([model.fused_optimizer, sgd])


def case_model(case: EquivalenceCase, sparse_device: torch.device, device: torch.device) -> SparseDenseModel:
    """The case's seeded model, its tables on ``sparse_device`` with the case's optimizer, the dense layer on ``device``."""
    model = SparseDenseModel(TABLE_SETS[case.tables], sparse_device, SEED, dense_device=device)
    cls, kwargs = OPTIMIZERS[case.optimizer]
    apply_optimizer_in_backward(cls, model.table_parameters(), dict(kwargs))  # TorchRec edits the dict it gets
    return model


def case_batches(case: EquivalenceCase) -> list[list[ModelBatch]]:
    """Every rank's batch of every step (``[step][rank]``): any rank can build any rank's."""
    tables = TABLE_SETS[case.tables]
    spec = BatchSpec(hot=case.settings.hot if case.hot_only else 0, seed=SEED)
    return [[train_batch(tables, r, step, spec) for r in range(case.world_size)] for step in range(case.steps)]


def case_profile(case: EquivalenceCase, steps: list[list[ModelBatch]]) -> AccessProfile:
    """The reads of every rank's batches, per table: what the planner prices."""
    tables = TABLE_SETS[case.tables]
    return profile_of([
        ([*tables.bags, *tables.sequences], [b.features for s in steps for b in s]),
        (list(tables.weighted), [b.weighted for s in steps for b in s]),
    ])  # fmt: skip


def case_topology(case: EquivalenceCase, device: torch.device) -> Topology:
    """The planner's topology; on several hosts the link between them is 10x slower than within one."""
    local = case.local_world_size or case.world_size
    links = {} if local == case.world_size else {"intra_host_bw": 2e9, "inter_host_bw": 2e8}
    return Topology(world_size=case.world_size, local_world_size=local, compute_device=device.type, **links)


def shard(
    case: EquivalenceCase, sharding_type: str, device: torch.device, profile: AccessProfile
) -> DistributedModelParallel:
    """The case's model planned by the plugin's planner (every table ``sharding_type`` but the
    case's stock tables; reads from ``profile``), sharded by the plugin's sharders, tables seeded."""
    model = case_model(case, torch.device("meta"), device)
    tables = TABLE_SETS[case.tables].tables
    settings = case.settings if sharding_type == case.sharding_type else None
    constraints = {
        t.name: ParameterConstraints(
            sharding_types=["row_wise" if t.name in case.stock_tables else sharding_type],
            compute_kernels=[EmbeddingComputeKernel.FUSED.value],
        )
        for t in tables
    }
    topology = case_topology(case, device)
    planner = HetEmbeddingShardingPlanner(
        topology=topology, constraints=constraints, pricing=plugin_pricing(settings, profile), link_probe=False
    )
    sharders = het_sharders(
        settings, tables, case.world_size, topology.local_world_size, profile, topology, qcomms=case.qcomms
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    sharded = DistributedModelParallel(model, device=device, plan=plan, sharders=sharders)
    set_tables(sharded, seeded_tables(tables, SEED))  # the dense layer is seeded alike
    return sharded


def train(
    case: EquivalenceCase, model: DistributedModelParallel, batches: list[ModelBatch], device
) -> list[torch.Tensor]:
    """Trains the sharded ``model`` on ``batches`` under the case's pipeline; each step's predictions."""
    optimizer = optimizer_of(model)
    batches = [b.to(device) for b in batches]
    if case.pipeline == "plain":
        out = []
        for b in batches:
            optimizer.zero_grad()
            loss, predictions = model(b)
            loss.backward()
            optimizer.step()
            out.append(predictions)
        return out
    if case.pipeline == "sparse_dist":
        pipeline = TrainPipelineSparseDist(model, optimizer, device)
    else:
        k = int(case.pipeline.removeprefix("hybrid_k"))
        pipeline = HybridTrainPipeline(model, optimizer, device, embedding_staleness=k, backward_on_worker=True)
    feed = iter(batches)
    out = [pipeline.progress(feed) for _ in batches]
    pipeline.detach()  # the model's own forward again (the every-row read calls it)
    return out


def train_unsharded(
    model: SparseDenseModel, optimizer, every_rank: list[ModelBatch], rank: int, device
) -> torch.Tensor:
    """One step of the unsharded ``model`` on every rank's batch (their mean loss); ``rank``'s predictions."""
    optimizer.zero_grad()
    outputs = [model(b.to(device)) for b in every_rank]
    (sum(loss for loss, _ in outputs) / len(outputs)).backward()
    optimizer.step()
    return outputs[rank][1]


@torch.no_grad()
def read_every_row(model: torch.nn.Module, case: EquivalenceCase, device) -> torch.Tensor:
    """Predictions, in evaluation, of one batch that reads every row."""
    model.eval()
    try:
        return model(every_row_batch(TABLE_SETS[case.tables]).to(device))[1]
    finally:
        model.train()


def remote_rows_read(
    model: DistributedModelParallel, case: EquivalenceCase, batches: list[ModelBatch]
) -> dict[str, int]:
    """Per sharded module of sequence tables (and of bag tables whose cold ids fetch rows,
    ``cold_rows``): distinct (table, row) pairs of this rank's batches that another rank owns (under
    the plan), summed over the steps: what fetching each remote row once per step moves."""
    rank, out = dist.get_rank(), {}
    tables = TABLE_SETS[case.tables]
    modules = {f"ecs.{module}": configs for module, configs in tables.sequence_modules().items()}
    if getattr(case.settings, "cold_rows", False):
        modules.update(tables.bag_modules())
    for path, configs in modules.items():
        count = 0
        for b in batches:
            features = (b.weighted if path == "wbc" else b.features).to_dict()
            for config in configs:
                shards = model.plan.plan[path][config.name].sharding_spec.shards
                ids = torch.unique(torch.cat([features[f].values() for f in config.feature_names]))
                for s in shards:
                    if s.placement.rank() != rank:
                        start = s.shard_offsets[0]
                        count += int(((ids >= start) & (ids < start + s.shard_sizes[0])).sum())
        out[path] = count
    return out


def sharded_vs_unsharded(case: EquivalenceCase, device: torch.device,
                         around_training: Callable[[], AbstractContextManager] = nullcontext) -> dict:  # fmt: skip
    """Trains the case's sharded model beside its reference: largest relative differences and counters.

    ``around_training()`` is entered while the sharded model trains (and only then): a tool that
    observes its communication, for instance.

    Returns:
        ``predictions`` (every step), ``tables`` and ``dense`` (at the end), ``every_row`` (the
        evaluation read after training), ``trained`` (the least any table of the reference
        moved, relative), ``stats`` (``torchrec_het.stats_by_table`` after training),
        ``remote_rows`` (:func:`remote_rows_read`), ``codec_effect`` (with ``qcomms``: the largest
        difference of its predictions from the unsharded model's, trained exactly) and, for ``het_row_replicated``,
        ``replica_disagreement`` (the largest difference of a replica from its owner's row at the end).
    """
    rank = dist.get_rank()
    tables = TABLE_SETS[case.tables]
    steps = case_batches(case)
    mine = [s[rank] for s in steps]
    profile = case_profile(case, steps)
    model = shard(case, case.sharding_type, device, profile)
    with around_training():
        got = train(case, model, mine, device)
    if case.reference == "unsharded":
        reference = case_model(case, device, device)  # seeded as the sharded model
        optimizer = optimizer_of(reference)
        want = [train_unsharded(reference, optimizer, s, rank, device) for s in steps]
        want_tables = {t.name: reference.table_weight(t.name).detach().cpu() for t in tables.tables}
    else:
        reference = shard(case, "row_wise", device, profile)
        want = train(case, reference, mine, device)
        want_tables = full_tables(reference, tables.tables)
    codec_effect = None
    if case.qcomms:  # the codecs reached the plugin's payloads: its predictions are not the exact ones
        exact = case_model(case, device, device)
        exact_optimizer = optimizer_of(exact)
        codec_effect = max(
            relative_error(g, train_unsharded(exact, exact_optimizer, s, rank, device)) for g, s in zip(got, steps)
        )
    got_tables = full_tables(model, tables.tables)  # state_dict(): what a type holds back is applied first
    dense = zip(get_unwrapped_module(model).over.parameters(), get_unwrapped_module(reference).over.parameters())
    result = {
        "predictions": max(relative_error(g, w) for g, w in zip(got, want)),
        "tables": max(relative_error(got_tables[n], want_tables[n]) for n in want_tables),
        "dense": max(relative_error(g, w) for g, w in dense),
        "trained": min(
            relative_error(want_tables[n], start) for n, start in seeded_tables(tables.tables, SEED).items()
        ),
        "stats": torchrec_het.stats_by_table(model),
        "remote_rows": remote_rows_read(model, case, mine),
        "codec_effect": codec_effect,
    }
    if case.sharding_type == HET_ROW_REPLICATED:
        result["replica_disagreement"] = replica_disagreement(model)  # after state_dict()'s flush
    result["every_row"] = relative_error(read_every_row(model, case, device), read_every_row(reference, case, device))
    return result


def run_cases(cases: list[EquivalenceCase], device: torch.device) -> dict[str, dict]:
    """Every case in order, ``{case name: result}``; a case that raises records ``{"error": traceback}``
    and the next one runs (a failure every rank meets at the same point leaves the group usable)."""
    out = {}
    for case in cases:
        try:
            out[case.name] = sharded_vs_unsharded(case, device)
        except Exception:  # noqa: BLE001 (recorded for the test to show)
            out[case.name] = {"error": traceback.format_exc()}
    return out


def run_world(rank: int, world_size: int, port: int, out_dir: str, cases: list[EquivalenceCase]) -> None:
    """Spawn target: ``cases`` on gloo (CPU); writes ``rank<r>.json``."""
    with gloo_rank(rank, world_size, port, timeout_s=120):
        write_rank_result(out_dir, rank, run_cases(cases, torch.device("cpu")))
