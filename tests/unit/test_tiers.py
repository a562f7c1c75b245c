"""Hot-row tiers: TorchRec's row-wise split, the memory model, and greedy tier selection within a budget."""

import math

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.planner.types import Topology
from torchrec.distributed.sharding_plan import (
    _calculate_rw_shard_sizes_and_offsets,
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection

from torchrec_het.replication import hot_rows, tier_selection
from torchrec_het.replication.memory import (
    TableMemory,
    TierTopology,
    bytes_per_row,
    plan_peak_bytes,
    row_owner,
    row_wise_sizes,
)
from torchrec_het.replication.profile import AccessProfile
from torchrec_het.replication.tier_selection import select_tiers
from torchrec_het.replication.tiers import TableTiers, TierPlan, layout_bytes_per_rank
from torchrec_het.sharders import CpuRowWiseEmbeddingBagCollectionSharder

ONE_HOST = TierTopology(4, 4, 1e11, 1e9)
TWO_HOSTS = TierTopology(4, 2, 1e11, 1e9)
NONE = torch.zeros(0, dtype=torch.int64)


def _ids(*rows: int) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.int64)


def _profile(tables: list[TableMemory], counts: list[torch.Tensor], batches: int = 10) -> AccessProfile:
    return AccessProfile(tuple(t.name for t in tables), tuple(t.num_rows for t in tables), tuple(counts), batches)


def _brute_layout(tables: list[TableMemory], tiers: dict, topo: TierTopology) -> list[int]:
    """Per-rank bytes straight from the placement rule, row by row."""
    ws, local = topo.world_size, topo.local_world_size
    out = [0] * ws
    for t in tables:
        sizes = [s[0] for s in _calculate_rw_shard_sizes_and_offsets(t.num_rows, ws, t.dim)[0]]
        owners = [r for r, size in enumerate(sizes) for _ in range(size)]
        rep = set(tiers[t.name].replicated.tolist()) if t.name in tiers else set()
        host = set(tiers[t.name].per_host.tolist()) if t.name in tiers else set()
        for rank in range(ws):
            for row, owner in enumerate(owners):
                held = owner == rank or row in rep
                held |= row in host and owner // local != rank // local and owner % local == rank % local
                out[rank] += t.bytes_per_row * held
    return out


def test_row_wise_split_is_torchrecs() -> None:
    assert row_wise_sizes(10, 4) == [3, 3, 3, 1] and row_wise_sizes(5, 4) == [2, 2, 1, 0]
    for rows, ws in [(10, 4), (5, 4), (12, 4), (7, 3), (1, 4), (101, 8), (64, 8)]:
        sizes, offsets = _calculate_rw_shard_sizes_and_offsets(rows, ws, 16)
        assert row_wise_sizes(rows, ws) == [s[0] for s in sizes]
        expected = [r for r, (size, _) in enumerate(sizes) for _ in range(size)]
        assert row_owner(torch.arange(rows), rows, ws).tolist() == expected
        table = TableMemory("t", rows, 16, 7)
        assert layout_bytes_per_rank([table], {}, TierTopology(ws, 1, 1.0, 1.0)) == [7 * s[0] for s in sizes]


def test_bytes_per_row() -> None:
    assert bytes_per_row(8, "sgd") == bytes_per_row(8, "exact_sgd") == bytes_per_row(8, EmbOptimType.EXACT_SGD) == 32
    assert bytes_per_row(8, "adagrad") == bytes_per_row(8, "exact_adagrad") == 64
    assert bytes_per_row(8, "rowwise_adagrad") == bytes_per_row(8, EmbOptimType.EXACT_ROWWISE_ADAGRAD) == 36
    assert bytes_per_row(8, "row_wise_adagrad") == bytes_per_row(8, "exact_row_wise_adagrad") == 36
    assert bytes_per_row(8, "adam") == bytes_per_row(8, "lamb") == 96
    assert bytes_per_row(8, "partial_rowwise_adam") == bytes_per_row(8, EmbOptimType.PARTIAL_ROWWISE_ADAM) == 68
    assert bytes_per_row(8, "rowwise_adagrad", weight_bytes=2) == 20  # fbgemm keeps the state in fp32
    with pytest.raises(ValueError, match="adamw"):
        bytes_per_row(8, "adamw")
    with pytest.raises(ValueError, match="madgrad"):
        bytes_per_row(8, EmbOptimType.MADGRAD)


def test_plan_peak_bytes_of_torchrec_plans() -> None:
    configs = [("a", 10, 8), ("b", 7, 4), ("c", 5, 4)]
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=name, feature_names=[f"f_{name}"], embedding_dim=dim, num_embeddings=rows)
            for name, rows, dim in configs
        ],
        device=torch.device("meta"),
    )
    tables = [TableMemory("a", 10, 8, 36), TableMemory("b", 7, 4, 16), TableMemory("c", 5, 4, 20)]

    def plan(per_param: dict) -> dict:
        return construct_module_sharding_plan(
            ebc,
            per_param,
            sharder=CpuRowWiseEmbeddingBagCollectionSharder(),
            local_size=2,
            world_size=4,
            device_type="cpu",
        )

    # table-wise: rank 1 holds a and b whole, rank 2 holds c
    tw = plan({"a": table_wise(rank=1), "b": table_wise(rank=1), "c": table_wise(rank=2)})
    assert plan_peak_bytes(tables, tw, 4) == 10 * 36 + 7 * 16
    # row-wise: a splits 3,3,3,1, b 2,2,2,1, c 2,2,1,0 -> rank 0 is the fullest
    rw = plan({"a": row_wise(), "b": row_wise(), "c": row_wise()})
    assert plan_peak_bytes(tables, rw, 4) == 3 * 36 + 2 * 16 + 2 * 20
    # data parallel: c whole on every rank; rank 3 also holds b whole and a's last row
    mixed = plan({"a": row_wise(), "b": table_wise(rank=3), "c": data_parallel()})
    assert plan_peak_bytes(tables, mixed, 4) == 1 * 36 + 7 * 16 + 5 * 20
    # column-wise: a's 8 columns split over ranks 0 and 1 (half the bytes of a row each)
    cw = plan({"a": column_wise(ranks=[0, 1]), "b": table_wise(rank=2), "c": table_wise(rank=3)})
    assert plan_peak_bytes(tables, cw, 4) == max(10 * 18, 7 * 16, 5 * 20)
    with pytest.raises(ValueError, match="'d'"):
        plan_peak_bytes(tables + [TableMemory("d", 3, 4, 16)], rw, 4)


def test_topology_from_torchrec_and_validation() -> None:
    topo = TierTopology.from_torchrec(
        Topology(world_size=4, compute_device="cpu", local_world_size=2, intra_host_bw=5e6, inter_host_bw=2e5)
    )
    assert (topo.world_size, topo.local_world_size, topo.num_hosts) == (4, 2, 2)
    assert [topo.host_of(r) for r in range(4)] == [0, 0, 1, 1]
    # torchrec's bandwidths are bytes/ms, ours bytes/s
    assert topo.intra_host_bandwidth == pytest.approx(5e9) and topo.inter_host_bandwidth == pytest.approx(2e8)
    with pytest.raises(ValueError, match="multiple"):
        TierTopology(4, 3, 1.0, 1.0)
    with pytest.raises(ValueError, match="positive"):
        TierTopology(4, 2, 0.0, 1.0)


def test_table_tiers_and_layout_by_hand() -> None:
    tt = TableTiers("t", 8, replicated=_ids(3), per_host=_ids(0, 5))
    assert tt.hot_fraction == pytest.approx(3 / 8)
    for replicated, per_host in ((_ids(3, 1), NONE), (_ids(8), NONE), (_ids(2), _ids(2, 4))):  # unsorted, outside, both
        with pytest.raises(ValueError, match="'t'"):
            TableTiers("t", 8, replicated, per_host)
    # 8 rows over 2 hosts x 2 ranks: owner(i) = i // 2; row 0 (owner 0) per host -> rank 2 holds it,
    # row 5 (owner 2) per host -> rank 0; row 3 (owner 1) replicated -> ranks 0, 2, 3
    table = TableMemory("t", 8, 4, 10)
    assert layout_bytes_per_rank([table], {"t": tt}, TWO_HOSTS) == [40, 20, 40, 30]
    assert layout_bytes_per_rank([table], {"t": tt}, ONE_HOST) == [30, 20, 30, 30]  # one host: per_host holds nothing
    plan = TierPlan({"t": tt}, 40, 40)
    assert plan.for_table("t") is tt
    with pytest.raises(KeyError, match="'u'"):
        plan.for_table("u")
    assert TierPlan.empty([table], TWO_HOSTS).peak_bytes == 20


def test_stale_replicas_count_twice_and_stay_within_the_budget() -> None:
    # replicas synced every s > 1 steps keep the agreed rows besides the rank's own steps
    tt = TableTiers("t", 8, replicated=_ids(3), per_host=NONE)
    once, twice = TableMemory("t", 8, 4, 10), TableMemory("t", 8, 4, 10, replica_copies=2)
    assert layout_bytes_per_rank([once], {"t": tt}, ONE_HOST) == [30, 20, 30, 30]
    assert layout_bytes_per_rank([twice], {"t": tt}, ONE_HOST) == [40, 20, 40, 40]
    tables = [TableMemory("a", 40, 8, 36, replica_copies=2)]
    profile = _profile(tables, [torch.arange(40, 0, -1) * 30], batches=20)
    budget = TierPlan.empty(tables, ONE_HOST).peak_bytes + 400
    plan = select_tiers(tables, profile, ONE_HOST, budget, max_hot_fraction=0.4)
    assert plan.for_table("a").replicated.numel() == 5  # 400 bytes hold 5 rows of 2 x 36, not 11 of 36
    assert plan.peak_bytes == max(layout_bytes_per_rank(tables, plan.tables, ONE_HOST)) <= budget


def test_cost_model_by_hand() -> None:
    """Saved seconds per step per added byte (over all ranks) of each promotion, as the model states it."""
    table = TableMemory("t", 40, 8, 36)
    rps = torch.tensor([0.5, 1.0, 3.0], dtype=torch.float64)
    got = tier_selection._Scorer(table, TWO_HOSTS).scores(rps)
    wire, intra, inter = 2 * 8 * 4, 1e11, 1e9  # 2 hosts x 2 ranks
    for row, r in enumerate(rps.tolist()):
        once = min(1.0, r)
        sharded = r * wire * (1 / 4 / intra + 2 / 4 / inter)
        per_host = r * wire * (1 / 2) / intra + once * wire * (1 / 2) / inter
        replicated = once * wire * (2 / intra + 1 / inter)  # an all-reduce: within both hosts, then between them
        saved = [(sharded - per_host, 1 * 36), (sharded - replicated, 3 * 36), (per_host - replicated, 2 * 36)]
        expected = [s / cost if s > 0 else -math.inf for s, cost in saved]
        assert got[row].tolist() == pytest.approx(expected, rel=1e-12)
    # a replicated row's all-reduce costs more than the per-host tier's combine at these reads
    assert got[0, 0] == -math.inf and got[1, 1] == -math.inf and got[2, 0] > got[2, 1] > 0
    assert got[2, 2] == -math.inf
    one_host = tier_selection._Scorer(table, ONE_HOST).scores(
        torch.cat([rps, torch.tensor([8.0], dtype=torch.float64)])
    )
    assert bool((one_host[:, [0, 2]] == -math.inf).all())
    # on one host of 4 ranks replication pays from 4 reads a step (one per rank): not at 3, at 8
    assert one_host[2, 1] == -math.inf and one_host[3, 1] > 0


def test_no_hot_rows_without_reads_or_room() -> None:
    tables = [TableMemory("a", 16, 4, 16), TableMemory("b", 8, 8, 32)]
    base = TierPlan.empty(tables, ONE_HOST).peak_bytes
    assert base == 4 * 16 + 2 * 32
    zeros = [torch.zeros(16, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)]
    idle = select_tiers(tables, _profile(tables, zeros), ONE_HOST, 10 * base)
    hot = [torch.arange(16, 0, -1) * 100, torch.arange(8) * 100]
    tight = select_tiers(tables, _profile(tables, hot), ONE_HOST, base)  # every rank is at the peak already
    for plan in (idle, tight):
        assert all(t.replicated.numel() == 0 and t.per_host.numel() == 0 for t in plan.tables.values())
        assert plan.peak_bytes == base
    with pytest.raises(ValueError, match=f"{base - 1}.*{base}"):
        select_tiers(tables, _profile(tables, hot), ONE_HOST, base - 1)


def test_mismatched_profile_names_the_table() -> None:
    tables = [TableMemory("a", 16, 4, 16), TableMemory("b", 8, 8, 32)]
    counts = torch.ones(16, dtype=torch.int64)
    with pytest.raises(ValueError, match="'b'"):
        select_tiers(tables, AccessProfile(("a",), (16,), (counts,), 1), ONE_HOST, 1 << 20)
    wrong_rows = AccessProfile(("a", "b"), (16, 9), (counts, torch.ones(9, dtype=torch.int64)), 1)
    with pytest.raises(ValueError, match="'b' has 9 rows in the profile but 8"):
        select_tiers(tables, wrong_rows, ONE_HOST, 1 << 20)


def test_hottest_rows_are_replicated_first() -> None:
    # 40 rows over 4 ranks (owner = row // 10); hotness cycles through the owners, so replicas
    # spread evenly and a binding budget keeps exactly the k hottest rows
    table = TableMemory("a", 40, 8, 36)
    hot_order = [owner * 10 + j for j in range(10) for owner in range(4)]
    counts = torch.zeros(40, dtype=torch.int64)
    counts[hot_order] = torch.arange(40, 0, -1) * 10  # distinct, hottest first
    profile = _profile([table], [counts], batches=20)
    base = TierPlan.empty([table], ONE_HOST).peak_bytes
    for extra_rows in (1, 2, 5, 7):
        budget = base + extra_rows * 36
        plan = select_tiers([table], profile, ONE_HOST, budget)
        tt = plan.for_table("a")
        assert 0 < tt.replicated.numel() <= 20 and tt.per_host.numel() == 0  # 20 = 50% cap
        assert tt.replicated.tolist() == sorted(profile.hottest("a", tt.replicated.numel()).tolist())
        assert plan.peak_bytes <= budget


def test_generous_and_binding_budgets_on_two_tables() -> None:
    tables = [TableMemory("a", 40, 8, 36), TableMemory("b", 24, 4, 20)]
    gen = torch.Generator().manual_seed(0)
    counts = [torch.randperm(40, generator=gen) * 7 + 1, torch.randperm(24, generator=gen) * 11 + 2]  # distinct counts
    profile = _profile(tables, counts, batches=20)  # one read a step saves nothing on one host
    base = TierPlan.empty(tables, ONE_HOST).peak_bytes
    generous = select_tiers(tables, profile, ONE_HOST, base + 100_000, max_hot_fraction=0.4)
    for table, k in zip(tables, (16, 9)):  # capped at 40% of the rows
        tt = generous.for_table(table.name)
        assert tt.replicated.tolist() == sorted(profile.hottest(table.name, k).tolist()) and tt.per_host.numel() == 0
    for budget in (base + 100, base + 400, base + 900):
        plan = select_tiers(tables, profile, ONE_HOST, budget, max_hot_fraction=0.4)
        layout = layout_bytes_per_rank(tables, plan.tables, ONE_HOST)
        assert plan.peak_bytes == max(layout) <= budget and plan.budget_bytes == budget
        assert layout == _brute_layout(tables, plan.tables, ONE_HOST)
        for table, c in zip(tables, counts):
            tt = plan.for_table(table.name)
            assert tt.per_host.numel() == 0 and bool((c[tt.replicated] > 20).all())
            # nothing left out would still fit: each skipped candidate overflows some rank
            for row in profile.hottest(table.name, int(0.4 * table.num_rows)).tolist():
                if c[row] > 20 and row not in tt.replicated.tolist():
                    more = torch.sort(torch.cat([tt.replicated, _ids(row)])).values
                    tiers = dict(plan.tables, **{table.name: TableTiers(table.name, table.num_rows, more, NONE)})
                    assert max(layout_bytes_per_rank(tables, tiers, ONE_HOST)) > budget


def test_slow_network_and_tight_budget_use_the_host_tier() -> None:
    tables = [TableMemory("a", 40, 8, 32)]
    counts = [torch.cat([torch.full((12,), 100), torch.zeros(28, dtype=torch.int64)])]
    profile = _profile(tables, counts, batches=10)
    base = TierPlan.empty(tables, TWO_HOSTS).peak_bytes
    budget = base + 4 * 32  # replicating the 12 hot rows (owners 0 and 1) would add 12 rows to ranks 2 and 3
    two = select_tiers(tables, profile, TWO_HOSTS, budget)
    assert two.for_table("a").per_host.numel() > 0 and two.peak_bytes <= budget
    assert layout_bytes_per_rank(tables, two.tables, TWO_HOSTS) == _brute_layout(tables, two.tables, TWO_HOSTS)
    one = select_tiers(tables, profile, ONE_HOST, budget)
    assert one.for_table("a").per_host.numel() == 0 and one.for_table("a").replicated.numel() > 0
    one_rank_per_host = TierTopology(4, 1, 1e11, 1e9)  # per host = every rank: the tier is never used
    assert select_tiers(tables, profile, one_rank_per_host, budget).for_table("a").per_host.numel() == 0


def _sequential_greedy(tables, profile, topo, budget, min_reads, max_fraction):
    """The selection spelled out one promotion at a time (scores from the module's cost model)."""
    ws, local = topo.world_size, topo.local_world_size
    gains = {
        0: lambda o, r: o // local != r // local and o % local == r % local,  # sharded -> per_host
        1: lambda o, r: o != r,  # sharded -> replicated
        2: lambda o, r: o != r and not (o // local != r // local and o % local == r % local),  # per_host -> replicated
    }
    old, new = {0: 0, 1: 0, 2: 1}, {0: 1, 1: 2, 2: 2}
    load = layout_bytes_per_rank(tables, {}, topo)
    cands = []
    for ti, t in enumerate(tables):
        c = profile.table_counts(t.name)
        rows = [i for i in range(t.num_rows) if c[i] > 0 and c[i] / profile.batches >= min_reads]
        rows = sorted(rows, key=lambda i: (-int(c[i]), i))[: int(max_fraction * t.num_rows)]
        if not rows:
            continue
        scores = tier_selection._Scorer(t, topo).scores(c[rows].double() / profile.batches).tolist()
        for i, (s_host, s_all, s_up) in zip(rows, scores):
            steps = [(s_host, 0), (s_up, 2)] if s_host > -math.inf and s_host >= s_up else [(s_all, 1), (s_host, 0)]
            cands += [(-s, ti, i, slot, kind) for slot, (s, kind) in enumerate(steps) if s > -math.inf]
    state = {}
    for _, ti, i, _, kind in sorted(cands):
        t = tables[ti]
        owner = int(row_owner(torch.tensor([i]), t.num_rows, ws))
        receivers = [r for r in range(ws) if gains[kind](owner, r)]
        if state.get((ti, i), 0) == old[kind] and all(load[r] + t.bytes_per_row <= budget for r in receivers):
            state[(ti, i)] = new[kind]
            for r in receivers:
                load[r] += t.bytes_per_row
    tiers = {}
    for ti, t in enumerate(tables):
        tier = [state.get((ti, i), 0) for i in range(t.num_rows)]
        tiers[t.name] = ([i for i, k in enumerate(tier) if k == 2], [i for i, k in enumerate(tier) if k == 1])
    return tiers, max(load)


@pytest.mark.parametrize("small_blocks", [True, False])
@pytest.mark.parametrize(
    "topo",
    [TWO_HOSTS, TierTopology(4, 2, 1e10, 1e10), TierTopology(6, 2, 1e10, 2e9), TierTopology(6, 3, 1e11, 5e8), ONE_HOST],
    ids=["2x2", "2x2-flat", "3x2", "2x3", "1x4"],
)
def test_blocked_selection_matches_one_at_a_time(topo: TierTopology, small_blocks: bool, monkeypatch) -> None:
    if small_blocks:  # many blocks and chunks, a row's two steps often split across them
        monkeypatch.setattr(tier_selection, "_BLOCK_ROWS", 5)
        monkeypatch.setattr(tier_selection, "_CHUNK_CELLS", 7 * topo.world_size)
    tables = [TableMemory("a", 37, 8, 36), TableMemory("b", 23, 4, 20), TableMemory("c", 50, 16, 68)]
    gen = torch.Generator().manual_seed(topo.world_size * 10 + topo.local_world_size)
    counts = [(200.0 / (torch.randperm(t.num_rows, generator=gen) + 1.0) ** 0.8).long() * 3 for t in tables]
    counts[1][:4] = counts[1][4]  # ties across rows
    profile = _profile(tables, counts, batches=8)
    base = TierPlan.empty(tables, topo).peak_bytes
    for extra in (0, 50, 300, 1000, 4000):
        plan = select_tiers(tables, profile, topo, base + extra, min_reads_per_step=0.5, max_hot_fraction=0.6)
        expected, peak = _sequential_greedy(tables, profile, topo, base + extra, 0.5, 0.6)
        got = {n: (tt.replicated.tolist(), tt.per_host.tolist()) for n, tt in plan.tables.items()}
        assert got == expected and plan.peak_bytes == peak <= base + extra
        assert layout_bytes_per_rank(tables, plan.tables, topo) == _brute_layout(tables, plan.tables, topo)


# --- the per-host tier without a budget (ProfileTiers and the planner) ---------------------


def test_host_tier_saving_by_hand() -> None:
    """Sharded: 2 rows per read, over the slow link for the owners on the other host; per host:
    2 rows per read within the host, and 1 row from every host that read it to the other host."""
    topo = TierTopology(4, 2, 10.0, 1.0)  # 2 hosts x 2 ranks, the link between hosts 10x slower
    reads = torch.tensor([0.0, 0.1, 1.0, 4.0], dtype=torch.float64)
    got = hot_rows.host_tier_saving(reads, topo)
    for r, saving in zip(reads.tolist(), got.tolist()):
        sharded = r * 2 * (1 / 4 / 10.0 + 2 / 4 / 1.0)
        per_host = r * 2 * (1 / 2) / 10.0 + 2 * (1 - math.exp(-r / 2)) * 1 / 1.0
        assert saving == pytest.approx(sharded - per_host, abs=1e-12)
    assert got[0] == 0.0 and got[1] < 0 < got[2] < got[3]  # rarely read rows stay sharded
    # one host, or one rank per host (the per-host tier is the replicated one): no saving
    for flat in (TierTopology(4, 4, 10.0, 1.0), TierTopology(4, 1, 10.0, 1.0)):
        assert bool((hot_rows.host_tier_saving(reads, flat) == 0).all())
    # the break-even read rate follows the bandwidth ratio
    grid = torch.linspace(0.01, 4.0, 400, dtype=torch.float64)
    first = [
        float(grid[hot_rows.host_tier_saving(grid, TierTopology(4, 2, ratio, 1.0)) > 0][0])
        for ratio in (2.0, 10.0, 100.0)
    ]
    assert first[0] > first[1] > first[2]


def test_per_host_rows_golden() -> None:
    """Rows 1, 3, 5 replicated; the rest by reads per step, 2 hosts x 2 ranks, inter-host link 10x slower."""
    topo = TierTopology(4, 2, 10.0, 1.0)
    reads = torch.tensor([0.9, 5.0, 0.05, 3.0, 0.4, 2.0, 0.9, 0.0], dtype=torch.float64)
    replicated = _ids(1, 3, 5)
    assert hot_rows.per_host_rows(reads, replicated, topo, max_rows=8).tolist() == [0, 4, 6]
    assert hot_rows.per_host_rows(reads, replicated, topo, max_rows=2).tolist() == [
        0,
        6,
    ]  # hottest first, ties: lower id
    assert hot_rows.per_host_rows(reads, replicated, topo, max_rows=0).numel() == 0
    assert hot_rows.per_host_rows(reads, replicated, TierTopology(4, 4, 10.0, 1.0), 8).numel() == 0
    ordered = torch.sort(reads, descending=True).values  # the planner's view: hottest first
    assert hot_rows.host_row_count(ordered, 3, topo, 8) == 3 and hot_rows.host_row_count(ordered, 3, topo, 1) == 1


@pytest.mark.parametrize("seed", range(4))
def test_hot_rows_are_the_hottest_admitted_ties_by_lower_id(seed: int) -> None:
    """The hot rows: every row read at least the threshold, the hottest ``max_hot_fraction`` of
    the table where that caps them, ties taken by lower id (as the hottest-first order defines)."""
    generator = torch.Generator().manual_seed(seed)
    reads = torch.randint(0, 6, (500,), generator=generator).double() / 2  # many ties
    for threshold, fraction in ((1.0, 1.0), (1.0, 0.1), (2.5, 0.02), (9.0, 0.5), (0.0, 0.3)):
        order = sorted(range(500), key=lambda row: (-reads[row].item(), row))  # hottest first, lower id first
        admitted = [row for row in order if reads[row] >= threshold][: math.floor(fraction * 500)]
        hot = hot_rows.hottest_rows(reads, threshold, fraction)
        assert hot.dtype == torch.int64 and hot.tolist() == sorted(admitted), (threshold, fraction)
