"""Train TorchRec's DLRM with torchrec_het: profile the data, plan, shard, train.

A whole training script, written the way a TorchRec user writes one, with the plugin's three
swaps: the planner gets an access profile (``AccessProfiler``), the sharders come from
``get_het_sharders``, and the planner is ``HetEmbeddingShardingPlanner``. It starts its own
ranks (``mp.spawn``, gloo on CPU), so plain ``python`` runs it:

    python examples/train_with_plugin.py                      # 2 ranks, links measured
    python examples/train_with_plugin.py --hosts 2 --inter-gbit 1.25
    python examples/train_with_plugin.py --staleness 2        # HybridTrainPipeline, k = 2
    python examples/train_with_plugin.py --cache-staleness 10 # het_cached_row_wise may read 10 stale

``--hosts 2`` plans the 2 ranks as 2 hosts of one rank each. ``--inter-gbit`` states the speed of
the link between hosts (Gbit/s per rank, every rank sending at once) instead of measuring it. On
one machine the ranks really talk over loopback, so the second command shows the plan the
planner would make for two hosts on a slow link, then trains with that plan here.

Rank 0 prints the planner's decision and why (``planner.decision.why``), each table's sharding
type with its predicted share of the step and the runner-up, the loss as it trains, and the
plugin's counters (``torchrec_het.stats_by_table``).
"""

import argparse
import logging
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torchrec
from torch.distributed.elastic.utils.distributed import get_free_port
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.datasets.utils import Batch
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner.storage_reservations import FixedPercentageStorageReservation
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

import torchrec_het
from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het.pipeline import HybridTrainPipeline
from torchrec_het.planner import AccessModel, HetEmbeddingShardingPlanner, PluginPricing
from torchrec_het.planner.step_model import Compute
from torchrec_het.replication import AccessProfiler, load_profile
from torchrec_het.sharders import get_het_sharders

DENSE_FEATURES = 13  # as Criteo's


class SkewedClicks:
    """Stands in for your data loader: one id per table per sample, drawn from a Zipf law.

    Hot rows are scattered over each table (as hashed ids are). The label depends on a hidden
    score per row, so a model that learns the embeddings lowers its loss. Batch ``step`` of
    ``rank`` is the same whoever asks for it.
    """

    def __init__(self, tables: int, rows: int, alpha: float, batch_size: int, seed: int) -> None:
        self.features = [f"f{t}" for t in range(tables)]
        self.rows, self.batch_size, self.seed = rows, batch_size, seed
        g = torch.Generator().manual_seed(seed)
        weights = torch.arange(1, rows + 1, dtype=torch.float64).pow(-alpha)
        self.cdf = (weights.cumsum(0) / weights.sum()).float()
        self.scatter = torch.stack([torch.randperm(rows, generator=g) for _ in range(tables)])
        self.score = torch.randn(tables, rows, generator=g)
        self.dense_weight = torch.randn(DENSE_FEATURES, generator=g) / DENSE_FEATURES**0.5

    def batch(self, step: int, rank: int) -> Batch:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1_009 + rank)
        tables, size = len(self.features), self.batch_size
        ranks = torch.searchsorted(self.cdf, torch.rand(tables, size, generator=g)).clamp_(max=self.rows - 1)
        ids = torch.gather(self.scatter, 1, ranks)  # [tables, batch]
        dense = torch.randn(size, DENSE_FEATURES, generator=g)
        logit = torch.gather(self.score, 1, ids).sum(0) / tables**0.5 + dense @ self.dense_weight
        labels = (torch.rand(size, generator=g) < torch.sigmoid(2 * logit)).float()
        sparse = KeyedJaggedTensor.from_lengths_sync(
            self.features, ids.reshape(-1), torch.ones(tables * size, dtype=torch.int32)
        )
        return Batch(dense_features=dense, sparse_features=sparse, labels=labels)


def build_model(data: SkewedClicks, dim: int) -> DLRMTrain:
    """DLRM with one table per feature, on the meta device (DistributedModelParallel places them)."""
    tables = [
        EmbeddingBagConfig(name=f"t_{f}", embedding_dim=dim, num_embeddings=data.rows, feature_names=[f])
        for f in data.features
    ]
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
            dense_in_features=DENSE_FEATURES,
            dense_arch_layer_sizes=[128, dim],
            over_arch_layer_sizes=[128, 1],
        )
    )


def make_profile(args: argparse.Namespace, path: str) -> None:
    """Swap 1: count the row reads of a sample of one rank's batches and save them."""
    data = SkewedClicks(args.tables, args.rows, args.alpha, args.batch_size, args.seed)
    profiler = AccessProfiler.for_model(build_model(data, args.dim))
    for step in range(0, args.profile_batches * 5, 5):  # every 5th batch: a 20% sample
        profiler.observe(data.batch(step, rank=0).sparse_features)
    profile = profiler.save(path)
    top = args.rows // 100
    share = sum(profile.coverage(f"t_{f}", top) for f in data.features) / len(data.features)
    print(f"profile: {profile.batches} batches; the hottest 1% of rows take {share:.0%} of reads", flush=True)


def train(rank: int, args: argparse.Namespace, port: int, profile_path: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.ranks)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.ranks))  # each rank its share of the cores
    torch.manual_seed(args.seed)
    device = torch.device("cpu")
    if args.print_stats:  # TorchRec's planner stats table (rank 0 plans), with the plugin's lines
        stats_log = logging.getLogger("torchrec.distributed.planner.stats")
        stats_log.setLevel(logging.INFO)
        stats_log.addHandler(logging.StreamHandler(sys.stdout))
        stats_log.propagate = False

    data = SkewedClicks(args.tables, args.rows, args.alpha, args.batch_size, args.seed)
    model = build_model(data, args.dim)
    tables = model.model.sparse_arch.embedding_bag_collection.embedding_bag_configs()
    apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, model.model.sparse_arch.parameters(), {"lr": args.lr})

    profile = load_profile(profile_path, tables)
    topology = TopologyFactory.create_topology(
        TrainerConfig(world_size=args.ranks, local_world_size=args.ranks // args.hosts),
        kernel_config=KernelConfig(compute_device=device.type),
    )
    # Swap 2: the plugin's sharders; the profile names the rows het_row_replicated replicates.
    cache = HetCacheConfig(default=CacheSettings(s_read=args.cache_staleness, s_write=args.cache_staleness))
    sharders = get_het_sharders(cache=cache, profile=profile, topology=topology)
    # Swap 3: the plugin's planner. It prices TorchRec's types and the plugin's with one model and
    # keeps the plugin's plan only where it is predicted faster by more than 10%.
    planner = HetEmbeddingShardingPlanner(
        topology=topology,
        batch_size=args.batch_size,
        storage_reservation=FixedPercentageStorageReservation(0.15),
        pricing=PluginPricing(AccessModel(profile, source=profile_path)),
        link_gbit=(None, args.inter_gbit) if args.inter_gbit else None,  # None: measure the links
        compute=Compute(*args.step_compute) if args.step_compute else None,  # None: measure it
        pipeline="hybrid" if args.staleness else "sparse_dist",
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    if rank == 0:
        print(f"planner: {planner.decision.why}", flush=True)
        if args.step_compute is None:  # the links and the compute the planner measured (or assumed)
            print(f"planner: {planner.cost_inputs.source}", flush=True)
        else:
            lookup, dense = args.step_compute
            print(f"planner: {planner.links.describe()}; compute stated (--step-compute): lookup "
                  f"{lookup * 1e9:g} ns/id, dense {dense * 1e6:g} us/sample", flush=True)  # fmt: skip
        chosen = plan.plan["model.sparse_arch.embedding_bag_collection"]
        shares = plan.het_prediction.tables if getattr(plan, "het_prediction", None) else {}
        for name, sharding in chosen.items():
            share = shares.get(name)
            detail = ""
            if share and share.get("share_ms") is not None:
                detail = f": {share['share_ms']} ms of the step"
                if share.get("runner_up"):
                    detail += f"; runner-up {share['runner_up']} {share.get('runner_up_share_ms')} ms"
            print(f"plan: {name} {sharding.sharding_type}{detail}", flush=True)

    model = DistributedModelParallel(model, plan=plan, sharders=sharders, device=device)
    dense = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=args.lr),
    )
    optimizer = CombinedOptimizer([model.fused_optimizer, dense])
    if args.staleness:  # embeddings at most k steps stale, dense part synchronous
        pipeline = HybridTrainPipeline(model, optimizer, device, embedding_staleness=args.staleness)
    else:
        pipeline = TrainPipelineSparseDist(model, optimizer, device)

    batches = (data.batch(step, rank) for step in range(args.steps))
    losses, started = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        loss, _logits, _labels = pipeline.progress(batches)
        losses.append(float(loss))
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            print(f"step {step} loss {losses[-1]:.4f}", flush=True)
    elapsed = time.perf_counter() - started
    model.state_dict()  # what a checkpoint takes: applies any update in flight
    stats = torchrec_het.stats_by_table(model)
    if rank == 0:
        window = max(1, min(10, args.steps // 4))
        first, last = sum(losses[:window]) / window, sum(losses[-window:]) / window
        print(f"trained {args.steps} steps in {elapsed:.1f} s; mean loss of the first {window} steps {first:.4f}, "
              f"of the last {window} {last:.4f}", flush=True)  # fmt: skip
        alike: dict[str, list[str]] = {}  # tables of one module share its replication counters
        for line in torchrec_het.describe_stats(stats):
            table, text = line.split(": ", 1)
            alike.setdefault(text, []).append(table)
        for text, tables in alike.items():
            print(f"stats: {', '.join(tables)}: {text}", flush=True)
    dist.destroy_process_group()


def step_compute(text: str) -> tuple[float, float]:
    """``LOOKUP_NS,DENSE_US`` in seconds per id and per sample."""
    try:
        lookup_ns, dense_us = (float(field) for field in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOOKUP_NS,DENSE_US (two numbers), got {text!r}") from None
    if not (lookup_ns > 0 and dense_us > 0):
        raise argparse.ArgumentTypeError(f"both figures must be > 0, got {text!r}")
    return lookup_ns * 1e-9, dense_us * 1e-6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--ranks", type=int, default=2, help="ranks to start on this machine (gloo, CPU)")
    parser.add_argument("--hosts", type=int, default=1, help="hosts the planner plans the ranks as (default 1)")
    parser.add_argument(
        "--inter-gbit", type=float, default=None,
        help="the link between hosts in Gbit/s per rank, stated instead of measured (needs --hosts > 1)",
    )  # fmt: skip
    parser.add_argument(
        "--step-compute", type=step_compute, default=None, metavar="LOOKUP_NS,DENSE_US",
        help="the compute the planner prices, stated instead of measured: a lookup's forward, backward and update "
        "in ns per id, the dense part's in us per sample (as $TORCHREC_HET_STEP_COMPUTE)",
    )  # fmt: skip
    parser.add_argument("--tables", type=int, default=8, help="embedding tables, one feature each")
    parser.add_argument("--rows", type=int, default=100_000, help="rows per table")
    parser.add_argument("--dim", type=int, default=64, help="embedding dimension")
    parser.add_argument("--alpha", type=float, default=1.2, help="Zipf exponent of the ids (0: uniform)")
    parser.add_argument("--batch-size", type=int, default=1024, help="samples per rank per step")
    parser.add_argument("--steps", type=int, default=100, help="training steps")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (embeddings and dense part)")
    parser.add_argument("--staleness", type=int, default=0, help="k > 0: HybridTrainPipeline, embeddings k stale")
    parser.add_argument(
        "--cache-staleness", type=int, default=0,
        help="s_read = s_write of het_cached_row_wise tables: reads at most this many updates stale (0: exact)",
    )  # fmt: skip
    parser.add_argument("--profile-batches", type=int, default=40, help="batches the access profile counts")
    parser.add_argument("--log-every", type=int, default=20, help="print the loss every N steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--print-stats", action="store_true", help="show TorchRec's planner stats table")
    args = parser.parse_args(argv)
    if args.ranks < 1 or args.hosts < 1 or args.ranks % args.hosts:
        parser.error(f"--ranks {args.ranks} must be a positive multiple of --hosts {args.hosts}")
    if args.inter_gbit is not None and (args.hosts < 2 or not args.inter_gbit > 0):
        parser.error("--inter-gbit needs --hosts 2 or more and a speed > 0")
    for name in ("tables", "rows", "dim", "batch_size", "steps", "profile_batches", "log_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.alpha < 0 or args.staleness < 0 or args.cache_staleness < 0:
        parser.error("--alpha, --staleness and --cache-staleness must be >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="train_with_plugin_") as folder:
        profile_path = os.path.join(folder, "profile.pt")
        make_profile(args, profile_path)
        mp.spawn(train, args=(args, get_free_port(), profile_path), nprocs=args.ranks)


if __name__ == "__main__":
    main()
