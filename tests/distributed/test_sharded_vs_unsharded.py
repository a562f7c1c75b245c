"""Every sharding type trains as the unsharded model: one generic body (TorchRec's
``sharding_single_rank_test`` in spirit), over the type's settings, the fused optimizers, the
pipelines and world sizes 2 and 3 (3 gives uneven shards; one rank per host for the per-host
tier), on TorchRec's awkward cases (a table read by two features, a feature feeding two tables,
weighted tables, mixed widths, mean pooling, EmbeddingCollection). The same body on 2 hosts x 2
ranks, with the bytes counted: tests/distributed/test_two_hosts.py.

Rank body: :func:`torchrec_het_testing.equivalence.sharded_vs_unsharded`; every case of one
world size runs in one process group. A case compares the predictions of every step, every
table and the dense layer at the end, and one evaluation batch that reads every row, with the
unsharded model trained on the global batch (or, under a pipeline stale by design, with the
same model on stock row_wise under that pipeline); then the plugin's own counters.
"""

import pytest

from torchrec_het.config import CacheSettings
from torchrec_het_testing.equivalence import EquivalenceCase, run_world
from torchrec_het_testing.expectations import case_problems
from torchrec_het_testing.settings import ReplicaSettings
from torchrec_het_testing.spawn import results_by_world

HET, REP = "het_cached_row_wise", "het_row_replicated"
EXACT_CACHE = CacheSettings(s_read=0, s_write=0, capacity=0.3)
HOT = ReplicaSettings(hot=8)
NO_HOT = ReplicaSettings(hot=0)
PER_HOST = ReplicaSettings(hot=4, per_host=3)  # with one rank per host: every rank holds them
ONLINE = ReplicaSettings(hot=0, online_profile_steps=3)
PROFILED = ReplicaSettings(from_profile=True)
ALL_OPTIMIZERS = ("sgd", "adagrad", "rowwise_adagrad")


def _cases(world_size: int) -> list[EquivalenceCase]:
    """The cases of one world size on one host per rank or one host in all (2 and 3 ranks)."""
    ws = {"world_size": world_size}
    per_rank_hosts = {"world_size": world_size, "local_world_size": 1}
    out = []
    # every type and setting, every fused optimizer, pooled (with weighted) and sequence tables
    for optimizer in ALL_OPTIMIZERS:
        for settings, world in ((EXACT_CACHE, ws), (HOT, ws), (NO_HOT, ws), (PER_HOST, per_rank_hosts)):
            kind = HET if isinstance(settings, CacheSettings) else REP
            out.append(EquivalenceCase("bags", kind, settings, optimizer, **world))
            if kind == REP:
                out.append(EquivalenceCase("sequences", kind, settings, optimizer, **world))
    # one width: the owners pool and step their rows themselves (row_replicated/owner.py), not the kernels' call
    for optimizer in ("sgd", "rowwise_adagrad"):
        out.append(EquivalenceCase("bags_one_width", REP, HOT, optimizer, **ws))
    out.append(EquivalenceCase("bags_one_width", REP, HOT, "rowwise_adagrad", "sparse_dist", **ws))
    out.append(EquivalenceCase("bags_one_width", REP, PER_HOST, "rowwise_adagrad", **per_rank_hosts))
    out.append(EquivalenceCase("bags_one_width", REP, NO_HOT, "adagrad", **ws))
    # TorchRec's ModelParallelTestShared tables (wide: 3 steps), sum and mean pooling; stock row_wise as the control
    for tables in ("torchrec", "torchrec_mean"):
        for optimizer in ("sgd", "rowwise_adagrad"):
            out.append(EquivalenceCase(tables, HET, EXACT_CACHE, optimizer, steps=3, **ws))
            out.append(EquivalenceCase(tables, REP, ReplicaSettings(hot=3), optimizer, steps=3, **ws))
            out.append(
                EquivalenceCase(tables, REP, ReplicaSettings(hot=2, per_host=2), optimizer, steps=3, **per_rank_hosts)
            )
            out.append(EquivalenceCase(tables, "row_wise", None, optimizer, steps=3, **ws))
    # TorchRec's pipeline, which runs the input dist of batch i + 1 before the forward of batch i
    for optimizer in ALL_OPTIMIZERS:
        out.append(EquivalenceCase("bags", HET, EXACT_CACHE, optimizer, "sparse_dist", **ws))
        out.append(EquivalenceCase("bags", REP, HOT, optimizer, "sparse_dist", **ws))
        out.append(EquivalenceCase("sequences", REP, HOT, optimizer, "sparse_dist", **ws))
    out.append(EquivalenceCase("bags", REP, ONLINE, "rowwise_adagrad", "sparse_dist", steps=6, **ws))
    out.append(EquivalenceCase("bags", REP, PER_HOST, "rowwise_adagrad", "sparse_dist", **per_rank_hosts))
    # the hybrid pipeline: k = 0 is synchronous; k >= 1 against stock row_wise under the same k
    # (replicas on mean-pooled tables beside sum-pooled weighted ones)
    for optimizer in ("sgd", "rowwise_adagrad"):
        out.append(EquivalenceCase("bags", HET, EXACT_CACHE, optimizer, "hybrid_k0", **ws))
        out.append(EquivalenceCase("torchrec", "table_wise", None, optimizer, "hybrid_k0", **ws))
        out.append(EquivalenceCase("torchrec", "row_wise", None, optimizer, "hybrid_k0", **ws))
        for k in (0, 1, 2):
            out.append(EquivalenceCase("torchrec_mean", REP, ReplicaSettings(hot=6), optimizer, f"hybrid_k{k}", **ws))
    # hot rows from the profile the planner priced (get_het_sharders(profile=...)) or counted online,
    # all-hot batches, a stock table beside plugin tables (quantized comms: test_quantized_comms.py)
    out.append(EquivalenceCase("bags", REP, PROFILED, "rowwise_adagrad", **ws))
    out.append(EquivalenceCase("bags", REP, ONLINE, "rowwise_adagrad", steps=6, **ws))
    for tables in ("bags", "sequences"):
        out.append(EquivalenceCase(tables, REP, ReplicaSettings(hot=12), "rowwise_adagrad", hot_only=True, **ws))
    no_skip = ReplicaSettings(hot=12, skip_all_hot=False)  # the exchanges run, with nothing in them
    out.append(EquivalenceCase("bags", REP, no_skip, "rowwise_adagrad", hot_only=True, **ws))
    out.append(EquivalenceCase("sequences", REP, ReplicaSettings(hot=6, per_host=2, stride=3), "rowwise_adagrad",
                               stock_tables=("s2",), **ws))  # fmt: skip
    return out + lookahead_cases(world_size) + cold_rows_cases(world_size)


def cold_rows_cases(world_size: int) -> list[EquivalenceCase]:
    """Cold ids that fetch their rows (``cold_rows``: each distinct row once, pooled by the reader)
    beside replicated and per-host rows, every fused optimizer, mixed and one width, mean pooling,
    TorchRec's pipeline and lookahead."""
    ws = {"world_size": world_size}
    rows, per_host = ReplicaSettings(hot=8, cold_rows=True), ReplicaSettings(hot=4, per_host=3, cold_rows=True)
    out = [EquivalenceCase("bags", REP, rows, optimizer, **ws) for optimizer in ALL_OPTIMIZERS]
    out.append(EquivalenceCase("bags", REP, ReplicaSettings(hot=0, cold_rows=True), "sgd", "sparse_dist", **ws))
    out.append(EquivalenceCase("bags", REP, per_host, "rowwise_adagrad", world_size=world_size, local_world_size=1))
    out.append(EquivalenceCase("bags_one_width", REP, rows, "adagrad", **ws))
    lookahead = ReplicaSettings(hot=8, lookahead=True, cold_rows=True)
    out.append(EquivalenceCase("bags_one_width", REP, lookahead, "rowwise_adagrad", "sparse_dist", **ws))
    out.append(EquivalenceCase("torchrec_mean", REP, ReplicaSettings(hot=3, cold_rows=True), "sgd", steps=3, **ws))
    return out


def lookahead_cases(world_size: int) -> list[EquivalenceCase]:
    """Lookahead on (owners send the next batch's partials early): the owners' cases above, unchanged."""
    ws = {"world_size": world_size}
    hot, none = ReplicaSettings(hot=8, lookahead=True), ReplicaSettings(hot=0, lookahead=True)
    per_host = ReplicaSettings(hot=4, per_host=3, lookahead=True)
    out = []
    for optimizer in ALL_OPTIMIZERS:
        for pipeline in ("plain", "sparse_dist"):
            out.append(EquivalenceCase("bags_one_width", REP, hot, optimizer, pipeline, **ws))
    out.append(EquivalenceCase("bags_one_width", REP, hot, "rowwise_adagrad", "hybrid_k0", **ws))
    out.append(EquivalenceCase("bags_one_width", REP, none, "adagrad", "sparse_dist", **ws))
    out.append(EquivalenceCase("bags_one_width", REP, per_host, "rowwise_adagrad", "sparse_dist",
                               world_size=world_size, local_world_size=1))  # fmt: skip
    out.append(EquivalenceCase("bags", REP, ReplicaSettings(hot=8, lookahead=True), "sgd", "sparse_dist", **ws))
    return out


CASES = _cases(2) + _cases(3)


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    """``results(world_size)``: every case of that world size, run in one process group the first
    time it is asked for, as ``{case name: [result per rank]}``."""
    return results_by_world(tmp_path_factory, run_world, CASES, "equivalence")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_sharded_trains_like_the_unsharded_model(worlds, case: EquivalenceCase) -> None:
    problems = case_problems(case, worlds(case.world_size)[case.name])
    assert not problems, "\n".join(problems)
