"""Rank bodies of tests/distributed/test_two_hosts.py: 4 ranks as 2 hosts x 2 (hosts 0, 0, 1, 1).

Every case of :data:`CASES` runs the generic sharded-vs-unsharded body
(:func:`~torchrec_het_testing.equivalence.sharded_vs_unsharded`) with the benchmark's
:class:`~torchrec_het_bench.comm.CommAccountant` around the sharded model's training, and adds the
embedding bytes it moved, summed over ranks: between ranks, between hosts, and in all-to-alls.
One process group of 4 ranks holds them all.

Cases: stock row_wise; hot rows replicated with a per-host tier (plain, under
``TrainPipelineSparseDist``, sequence tables plain, under ``TrainPipelineSparseDist`` and the
hybrid pipeline at k = 2, TorchRec's tables under the hybrid pipeline at k = 2); the replicated tier alone with the replicas' gradients summed within hosts first
(hierarchical) and as one host of 4 (flat); tiers :class:`~torchrec_het.planner.ProfileTiers`
chose from a profile on a topology whose link between hosts is 10x slower; and cold traffic in
fp32 and in bf16 on one host of 4.
"""

import traceback

import torch

from torchrec_het.planner import ProfileTiers
from torchrec_het_bench.comm import EMBEDDING_PHASES, CommAccountant, sum_over_ranks
from torchrec_het_testing.equivalence import (
    EquivalenceCase,
    case_batches,
    case_profile,
    case_topology,
    sharded_vs_unsharded,
)
from torchrec_het_testing.settings import ReplicaSettings
from torchrec_het_testing.spawn import gloo_rank, write_rank_result

REP = "het_row_replicated"
HOSTS = (0, 0, 1, 1)
TWO_HOSTS = {"world_size": 4, "local_world_size": 2}
PER_HOST = ReplicaSettings(hot=4, per_host=12)
CASES = {
    "row_wise": EquivalenceCase("bags", "row_wise", **TWO_HOSTS),
    "per_host": EquivalenceCase("bags", REP, PER_HOST, **TWO_HOSTS),
    "per_host_sparse_dist": EquivalenceCase("bags", REP, PER_HOST, pipeline="sparse_dist", **TWO_HOSTS),
    "per_host_sequences": EquivalenceCase("sequences", REP, PER_HOST, **TWO_HOSTS),
    "per_host_sequences_sparse_dist": EquivalenceCase("sequences", REP, PER_HOST, pipeline="sparse_dist", **TWO_HOSTS),
    "per_host_sequences_hybrid_k2": EquivalenceCase("sequences", REP, PER_HOST, pipeline="hybrid_k2", **TWO_HOSTS),
    "per_host_hybrid_k2": EquivalenceCase(
        "torchrec", REP, ReplicaSettings(hot=4, per_host=3), pipeline="hybrid_k2", **TWO_HOSTS
    ),  # fmt: skip
    "hierarchical": EquivalenceCase("bags", REP, ReplicaSettings(hot=12), **TWO_HOSTS),
    "flat": EquivalenceCase("bags", REP, ReplicaSettings(hot=12), world_size=4),
    "profiled": EquivalenceCase("bags", REP, ReplicaSettings(from_profile=True), **TWO_HOSTS),  # a per-host tier too
    # TorchRec's quantized comms on the plugin's sharders (the reference: stock row_wise under them)
    "wire_fp32": EquivalenceCase("torchrec", REP, ReplicaSettings(hot=4), world_size=4),
    "wire_fp16_bf16": EquivalenceCase(
        "torchrec", REP, ReplicaSettings(hot=4), world_size=4, qcomms="fp16/bf16", tolerance=2e-2
    ),  # fmt: skip
}


def with_bytes(case: EquivalenceCase) -> dict:
    """The case's result (:func:`~torchrec_het_testing.equivalence.sharded_vs_unsharded`) and, as
    ``bytes``, the embedding bytes its sharded model moved while training, summed over ranks
    (``cross_rank``, ``inter_host`` on the hosts of :data:`HOSTS`, ``all_to_all``)."""
    accountant = CommAccountant()
    result = sharded_vs_unsharded(case, torch.device("cpu"), around_training=lambda: accountant)
    totals = sum_over_ranks(accountant.totals())
    result["bytes"] = {
        "cross_rank": totals.cross_rank(EMBEDDING_PHASES),
        "inter_host": totals.inter_host(HOSTS, EMBEDDING_PHASES),
        "all_to_all": sum(map(sum, totals.matrix(EMBEDDING_PHASES, families=["all_to_all"]))),
    }
    return result


def profiled_tiers(case: EquivalenceCase) -> dict[str, list[int]]:
    """Per table, (replicated, per-host) rows the sharders take from the case's profile on its topology."""
    tiers = ProfileTiers(case_profile(case, case_batches(case)), topology=case_topology(case, torch.device("cpu")))
    return {name: [t.replicated.numel(), t.per_host.numel()] for name, t in tiers.tables.items()}


def run_world(rank: int, world_size: int, port: int, out_dir: str) -> None:
    """Spawn target (4 ranks): every case of :data:`CASES` (a case that raises records
    ``{"error": traceback}``), and the tiers of the profiled one; writes ``rank<r>.json``."""
    if world_size != len(HOSTS):
        raise ValueError(f"the two-host cases need {len(HOSTS)} ranks, got {world_size}")
    with gloo_rank(rank, world_size, port, timeout_s=120):
        out: dict = {}
        for name, case in CASES.items():
            try:
                out[name] = with_bytes(case)
            except Exception:  # noqa: BLE001 (recorded for the test to show)
                out[name] = {"error": traceback.format_exc()}
        out["profiled_tiers"] = profiled_tiers(CASES["profiled"])
        write_rank_result(out_dir, rank, out)
