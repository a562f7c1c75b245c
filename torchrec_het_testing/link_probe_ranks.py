"""Rank bodies for the link probe on a gloo group (tests/distributed/test_link_probe.py)."""

import dataclasses
import time

import torch
import torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner import Topology

from torchrec_het.planner import AccessModel, HetEmbeddingShardingPlanner, PluginPricing
from torchrec_het.planner.link_probe import ProbeBudget, probe_links
from torchrec_het.planner.network import LinkSettings, link_figures
from torchrec_het.sharders import HetEmbeddingBagCollectionSharder
from torchrec_het_testing.spawn import gloo_rank, write_rank_result

# small enough that a 2-core machine probes in well under a second
TIGHT = ProbeBudget(seconds=1.0, first_bytes=1 << 12, max_bytes=1 << 20, repeats=2)


def _ebc() -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(name=f"t{i}", feature_names=[f"f{i}"], embedding_dim=8, num_embeddings=500) for i in range(2)
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def planner_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """One host per rank: the planner's ``collective_plan`` probes between hosts once (a second call
    reuses it) where a table may take a plugin type (a stated skew), and not at all where none may
    (no evidence); writes what each rank got."""
    with gloo_rank(rank, world_size, port):
        topology = Topology(world_size=world_size, local_world_size=1, compute_device="cpu")
        skewed = PluginPricing(AccessModel(alpha=1.05))
        planner = HetEmbeddingShardingPlanner(topology=topology, batch_size=64, link_budget=TIGHT, pricing=skewed)
        plan = planner.collective_plan(_ebc(), [HetEmbeddingBagCollectionSharder()], dist.GroupMember.WORLD)
        first = planner.links
        planner.collective_plan(_ebc(), [HetEmbeddingBagCollectionSharder()], dist.GroupMember.WORLD)
        unskewed = HetEmbeddingShardingPlanner(topology=topology, batch_size=64, link_budget=TIGHT)
        unskewed.collective_plan(_ebc(), [HetEmbeddingBagCollectionSharder()], dist.GroupMember.WORLD)
        result = {
            "planner": first.as_dict(),
            "probed_once": planner.links.probe is first.probe,
            "tables": sorted(plan.plan[""]),
            "without_evidence": unskewed.links.as_dict(),
        }
        write_rank_result(out_dir, rank, result)


def probe_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Two hosts of ``world_size // 2`` ranks: every kind probed on the tight budget; writes the figures."""
    with gloo_rank(rank, world_size, port):
        local = world_size // 2
        probe = probe_links(dist.GroupMember.WORLD, local, torch.device("cpu"), TIGHT)
        topology = Topology(world_size=world_size, local_world_size=local, compute_device="cpu")
        write_rank_result(out_dir, rank, link_figures(topology, LinkSettings(), probe).as_dict())


def budgets_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """One host per rank, the link between hosts probed three times on the tight budget: as is, with
    a low ``enough_bytes_per_ms``, and with rank 1 sleeping in every other round of the largest size
    (a dispersed series); writes each probe's figures."""
    with gloo_rank(rank, world_size, port):
        group, cpu = dist.GroupMember.WORLD, torch.device("cpu")
        plain = probe_links(group, 1, cpu, TIGHT, kinds=["inter"])
        enough = probe_links(group, 1, cpu, dataclasses.replace(TIGHT, enough_bytes_per_ms=100.0), kinds=["inter"])
        exchange, calls = dist.all_to_all_single, [0]

        def sometimes_slow(output, tensor, *args, **kwargs):
            if tensor.numel() * 4 >= TIGHT.max_bytes:
                calls[0] += 1
                if rank == 1 and calls[0] % 2:
                    time.sleep(0.03)
            return exchange(output, tensor, *args, **kwargs)

        dist.all_to_all_single = sometimes_slow
        try:
            dispersed = probe_links(group, 1, cpu, TIGHT, kinds=["inter"])
        finally:
            dist.all_to_all_single = exchange
        topology = Topology(world_size=world_size, local_world_size=1, compute_device="cpu")
        figures = {name: link_figures(topology, LinkSettings(), probe) for name, probe in
                   (("plain", plain), ("enough", enough), ("dispersed", dispersed))}  # fmt: skip
        write_rank_result(
            out_dir,
            rank,
            {
                name: {**f.as_dict(), "steady": f.probe.steady, "why": f.probe.why, "describe": f.describe()}
                for name, f in figures.items()
            },
        )
