"""What one training step of a 26-table DLRM costs on the host: syncs, collectives, time.

Rank bodies of tests/distributed/test_het_step_costs.py, and a small timing tool::

    python -m torchrec_het_bench.testing.het_step_ranks --preset default --steps 20

:func:`step_costs` trains a DLRM (TorchRec's ``DLRMTrain``) whose 26 tables are all
``het_cached_row_wise`` (or stock ``row_wise`` / ``table_wise``) with fused row-wise
Adagrad on synthetic Zipf(1.1) batches, and reports per measured step the host syncs
(:func:`~torchrec_het_testing.host_syncs.count_host_syncs`), the collectives issued in
the forward and in the backward (:class:`~torchrec_het_bench.comm.accounting.CommAccountant`),
and the seconds spent in the embedding module's forward and backward.
"""

import argparse
import statistics
import time
from collections import Counter

import torch
import torchrec.optim
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, row_wise, table_wise
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het.sharders import CpuRowWiseEmbeddingBagCollectionSharder, HetEmbeddingBagCollectionSharder
from torchrec_het.sharding import het_cached_row_wise
from torchrec_het_bench.comm.accounting import CommAccountant
from torchrec_het_bench.data.config import DataConfig, preset_table_sizes
from torchrec_het_bench.data.synthetic import SyntheticCriteo
from torchrec_het_bench.table_init import init_tables_by_row
from torchrec_het_testing.host_syncs import count_host_syncs, total
from torchrec_het_testing.spawn import gloo_rank, spawn_world, write_rank_result

# kind -> cache settings (None: a stock type)
KINDS: dict[str, CacheSettings | None] = {
    "het_s0": CacheSettings(),
    "het_s10": CacheSettings(s_read=10, s_write=10),
    "row_wise": None,
    "table_wise": None,
}
SMALL_ROWS = 2_000  # rows of every table in the test's small version of the 26 tables


def _tables(sizes: list[int], dim: int) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(name=f"t_cat_{i}", feature_names=[f"cat_{i}"], embedding_dim=dim, num_embeddings=rows)
        for i, rows in enumerate(sizes)
    ]


class EmbeddingsOnly(torch.nn.Module):
    """The embedding module alone under a quadratic loss, called like ``DLRMTrain`` (for timing the tables)."""

    def __init__(self, ebc: EmbeddingBagCollection) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, batch):
        loss = (self.ebc(batch.sparse_features).values() ** 2).mean()
        return loss, loss.detach()


def build(
    kind: str, sizes: list[int], dim: int, world_size: int, embeddings_only: bool = False
) -> tuple[DistributedModelParallel, CombinedOptimizer]:
    """A DLRM (or the tables alone) whose tables are all ``kind``, fused row-wise Adagrad on the
    tables, Adagrad on the rest."""
    torch.manual_seed(0)
    tables = _tables(sizes, dim)
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    if embeddings_only:
        model = EmbeddingsOnly(ebc)
    else:
        model = DLRMTrain(DLRM(ebc, 13, [32, dim], [32, 1], dense_device=torch.device("cpu")))
    apply_optimizer_in_backward(torchrec.optim.RowWiseAdagrad, ebc.parameters(), {"lr": 0.05})
    settings = KINDS[kind]
    if settings is not None:
        sharder, generator = (
            HetEmbeddingBagCollectionSharder(cache=HetCacheConfig(default=settings)),
            het_cached_row_wise,
        )
    elif kind == "row_wise":
        sharder, generator = CpuRowWiseEmbeddingBagCollectionSharder(), row_wise
    else:
        sharder, generator = CpuRowWiseEmbeddingBagCollectionSharder(), lambda: table_wise(rank=0)
    per_param = {}
    for i, t in enumerate(tables):
        per_param[t.name] = table_wise(rank=i % world_size) if kind == "table_wise" else generator()
    plan = construct_module_sharding_plan(
        ebc, per_param_sharding=per_param, world_size=world_size, device_type="cpu", sharder=sharder
    )
    path = "ebc" if embeddings_only else "model.sparse_arch.embedding_bag_collection"
    dmp = DistributedModelParallel(
        model, device=torch.device("cpu"), plan=ShardingPlan({path: plan}), sharders=[sharder]
    )
    init_tables_by_row(dmp, tables, 0)
    dense_params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    if not dense_params:
        return dmp, CombinedOptimizer([dmp.fused_optimizer])
    dense = KeyedOptimizerWrapper(dense_params, lambda p: torch.optim.Adagrad(p, lr=0.05))
    return dmp, CombinedOptimizer([dmp.fused_optimizer, dense])


def _embedding_module(dmp: DistributedModelParallel):
    module = dmp._dmp_wrapped_module
    module = getattr(module, "module", module)  # under DDP when there are dense parameters
    return module.ebc if isinstance(module, EmbeddingsOnly) else module.model.sparse_arch.embedding_bag_collection


def step_costs(
    rank: int,
    world_size: int,
    kind: str,
    sizes: list[int],
    dim: int,
    batch_size: int,
    warmup: int,
    steps: int,
    where: bool = False,
    profile: str | None = None,
    embeddings_only: bool = False,
) -> dict:
    """Per measured step (after ``warmup`` steps): host syncs, collectives (forward, backward), seconds.

    Returns:
        ``{"syncs": [per step], "sync_kinds": {method: count over all steps},
        "fwd_collectives": [...], "bwd_collectives": [...], "fwd_s": [...], "bwd_s": [...],
        "step_s": [...], "cpu_s": [...] (this process's CPU time of the step), "sites": {site: count}}``
        (sites only with ``where``).
    """
    data = SyntheticCriteo(DataConfig(table_sizes=tuple(sizes), batch_size=batch_size, seed=1))
    dmp, optimizer = build(kind, sizes, dim, world_size, embeddings_only)
    ebc = _embedding_module(dmp)
    timings = {"fwd": 0.0, "bwd": 0.0}
    started = {}

    def pre_forward(module, args):
        started["fwd"] = time.perf_counter()

    def post_forward(module, args, output):
        timings["fwd"] += time.perf_counter() - started["fwd"]

    ebc.register_forward_pre_hook(pre_forward)
    ebc.register_forward_hook(post_forward)
    accountant = CommAccountant()
    out: dict = {k: [] for k in ("syncs", "fwd_collectives", "bwd_collectives", "fwd_s", "bwd_s", "step_s", "cpu_s")}
    kinds: Counter = Counter()
    sites: Counter = Counter()
    profiler = None
    for step in range(warmup + steps):
        batch = data.batch(step, rank)
        measured = step >= warmup
        if profile and rank == 0 and step == warmup:
            import cProfile

            profiler = cProfile.Profile()
            profiler.enable()
        timings.update(fwd=0.0, bwd=0.0)
        with accountant, count_host_syncs(where=where) as syncs:
            accountant.reset()
            begin, cpu_begin = time.perf_counter(), time.process_time()
            loss, _ = dmp(batch)
            fwd_calls = sum(accountant.totals().calls.values())
            accountant.reset()
            backward_begin = time.perf_counter()
            loss.backward()
            backward_s = time.perf_counter() - backward_begin
            optimizer.step()
            optimizer.zero_grad()
            bwd_calls = sum(accountant.totals().calls.values())
            step_s = time.perf_counter() - begin
            cpu_s = time.process_time() - cpu_begin
        if measured:
            out["syncs"].append(total(syncs))
            out["fwd_collectives"].append(fwd_calls)
            out["bwd_collectives"].append(bwd_calls)
            out["fwd_s"].append(timings["fwd"])
            out["bwd_s"].append(backward_s)
            out["step_s"].append(step_s)
            out["cpu_s"].append(cpu_s)
            kinds.update({k: n for k, n in syncs.items() if not k.startswith("at:")})
            sites.update({k[3:]: n for k, n in syncs.items() if k.startswith("at:")})
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(f"{profile}.{kind}")
    out["sync_kinds"] = dict(kinds)
    out["sites"] = dict(sites.most_common())
    out["wire_widths"] = _wire_widths(ebc)
    return out


def _wire_widths(ebc) -> list[list[int]]:
    """Per HET group: (dim, floats an owner sends per fetched row, floats of one pushed row)."""
    from torchrec_het._compat import sharded_lookups
    from torchrec_het.sharding.het_cache.lookup import HetCachedEmbeddingLookup
    from torchrec_het.sharding.het_cache.pushes import HetPushes

    lookups = [lookup for lookup in sharded_lookups(ebc) if isinstance(lookup, HetCachedEmbeddingLookup)]
    return [[g.dim, g.fetch_width, HetPushes.width(g)] for lookup in lookups for g in lookup.groups]


def run_world(rank: int, world_size: int, port: int, out_dir: str, cases=None) -> None:
    """Spawn target of the test: step costs of every kind on 26 small tables."""
    cases = cases or {"kinds": list(KINDS), "sizes": [SMALL_ROWS] * 26, "dim": 8, "batch": 64, "warmup": 3, "steps": 4}
    with gloo_rank(rank, world_size, port, timeout_s=300):
        results = {
            kind: step_costs(
                rank,
                world_size,
                kind,
                cases["sizes"],
                cases["dim"],
                cases["batch"],
                cases["warmup"],
                cases["steps"],
                where=cases.get("where", False),
                profile=cases.get("profile"),
                embeddings_only=cases.get("embeddings_only", False),
            )
            for kind in cases["kinds"]
        }
    write_rank_result(out_dir, rank, results)


class WithCases:
    """A picklable spawn target: :func:`run_world` with the given cases."""

    def __init__(self, cases: dict) -> None:
        self.cases = cases

    def __call__(self, rank: int, world_size: int, port: int, out_dir: str) -> None:
        run_world(rank, world_size, port, out_dir, self.cases)


def main() -> None:
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="default", choices=["smoke", "default", "small"])
    parser.add_argument("--kinds", default="het_s0,het_s10,row_wise")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--where", action="store_true", help="print the sites of host syncs")
    parser.add_argument("--profile", help="cProfile rank 0's measured steps into PROFILE.<kind>")
    parser.add_argument("--embeddings-only", action="store_true", help="time the tables alone (no DLRM dense part)")
    args = parser.parse_args()
    if args.preset == "small":
        sizes, dim, batch = [SMALL_ROWS] * 26, 8, 64
    else:
        sizes = list(preset_table_sizes(args.preset))
        dim, batch = (64, 1024) if args.preset == "default" else (16, 256)
    cases = {
        "kinds": args.kinds.split(","),
        "sizes": sizes,
        "dim": dim,
        "batch": batch,
        "warmup": args.warmup,
        "steps": args.steps,
        "where": args.where,
        "profile": args.profile,
        "embeddings_only": args.embeddings_only,
    }
    with tempfile.TemporaryDirectory() as out:
        ranks = spawn_world(WithCases(cases), args.world_size, out)
    for kind in cases["kinds"]:
        r0 = ranks[0][kind]
        med = {k: statistics.median(r0[k]) for k in ("fwd_s", "bwd_s", "step_s", "cpu_s")}
        print(
            f"{kind:12s} syncs/step {r0['syncs']} fwd colls {r0['fwd_collectives'][0]} bwd colls "
            f"{r0['bwd_collectives'][0]}  median fwd {med['fwd_s'] * 1e3:.1f} ms bwd {med['bwd_s'] * 1e3:.1f} ms "
            f"step {med['step_s'] * 1e3:.1f} ms (cpu {med['cpu_s'] * 1e3:.1f} ms)  {r0['sync_kinds']}"
        )
        if args.where:
            for site, n in list(r0["sites"].items())[:40]:
                print(f"    {n:5d}  {site}")


if __name__ == "__main__":
    main()
