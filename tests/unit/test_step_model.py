"""The step model (torchrec_het.planner.step_model): bytes per phase by hand, overlap per pipeline."""

import math

import pytest
import torch

from torchrec_het.planner.access import zipf_shares
from torchrec_het.planner.step_model import Cluster, Compute, Links, PlannedTable, plan_bytes, predict_step, table_bytes
from torchrec_het.planner.traffic import TableLoad, counts_bytes, row_replicated_bytes
from torchrec_het.replication.hot_rows import replication_threshold

CLUSTER = Cluster(world_size=4, local_world_size=4, batch=100)


def _table(kind: str, **kw) -> PlannedTable:
    defaults = dict(name="t", rows=1000, dim=8, features=2, ids_per_sample=3.0, sharding_type=kind)
    return PlannedTable(**{**defaults, **kw})


def test_stock_bytes_are_torchrec_encodings() -> None:
    """table_wise: int32 lengths and int64 ids of the 3 of 4 ranks that do not hold the table, pooled
    bags back and their gradients; row_wise: every bag's length to every other rank, ids to their
    owners, every rank's partial of every bag reduce-scattered and all-gathered."""
    bags, ids, ws = 100 * 4 * 2, 100 * 4 * 3.0, 4
    tw = table_bytes(_table("table_wise", owners=(0,)), CLUSTER)
    assert tw.ids == pytest.approx((bags * 4 + ids * 8) * 3 / 4)
    assert tw.emb_fwd == tw.emb_bwd == pytest.approx(bags * 8 * 4 * 3 / 4)
    rw = table_bytes(_table("row_wise"), CLUSTER)
    assert rw.ids == pytest.approx(bags * 4 * (ws - 1) + ids * 3 / 4 * 8)
    assert rw.emb_fwd == rw.emb_bwd == pytest.approx(bags * 8 * 4 * (ws - 1))
    weighted = table_bytes(_table("table_wise", owners=(0,), weighted=True), CLUSTER)
    assert weighted.ids - tw.ids == pytest.approx(ids * 4 * 3 / 4)  # an fp32 weight beside each id
    dp = table_bytes(_table("data_parallel"), CLUSTER)
    assert (dp.ids, dp.emb_fwd, dp.emb_bwd) == (0.0, 0.0, pytest.approx(2 * 3 * 1000 * 8 * 4))


def test_nothing_moves_on_one_rank() -> None:
    one = Cluster(1, 1, 100)
    for kind in ("table_wise", "row_wise", "het_row_replicated"):
        assert table_bytes(_table(kind, reads=torch.ones(1000, dtype=torch.float64)), one).total == 0.0


def test_the_plugin_groups_pay_their_counts_once() -> None:
    reads = zipf_shares(1000, 1.1) * 100 * 4 * 3
    tables = [_table("het_row_replicated", name=f"t{i}", reads=reads, hot=reads[:10]) for i in range(3)]
    alone = sum(table_bytes(t, CLUSTER).ids for t in tables)
    assert plan_bytes(tables, CLUSTER).ids == pytest.approx(alone + counts_bytes(4))


@pytest.mark.parametrize("ws", [2, 4, 8])
def test_a_row_pays_for_replication_from_one_read_per_rank(ws: int) -> None:
    """Well below replication_threshold a row moves fewer bytes sharded, above it replicated (a wide
    row, whose partials and sync dwarf its ids; just below the bar, a row some rank skips in a step
    skips its sync too)."""
    bar = replication_threshold(ws)
    for reads, replicate in ((0.25 * bar, False), (2.0 * bar, True)):
        load = TableLoad(torch.tensor([reads], dtype=torch.float64), 10_000.0, 512, ws)
        sharded, replicated = row_replicated_bytes(load, 0).total, row_replicated_bytes(load, 1).total
        assert (replicated < sharded) == replicate, (ws, reads, sharded, replicated)


def test_the_sync_is_dense_when_most_rows_were_touched() -> None:
    """Every hot row read often: one all-reduce of dim + 1 floats a row; rarely read: touch counts,
    then the touched rows' gradients."""
    often = TableLoad(torch.full((100,), 50.0, dtype=torch.float64), 1000.0, 16, 4)
    assert row_replicated_bytes(often, 100).sync == pytest.approx(2 * 3 * 100 * 17 * 4, rel=1e-6)
    rare = TableLoad(torch.full((100,), 0.1, dtype=torch.float64), 1000.0, 16, 4)
    touched = 100 * (1 - math.exp(-0.1))
    assert row_replicated_bytes(rare, 100).sync == pytest.approx(2 * 3 * (100 + touched * 16) * 4)


def test_pipelines_hide_what_they_overlap() -> None:
    links = Links(1e9, 1e8, 1e-4)
    compute = Compute(lookup_s_per_id=1e-7, dense_s_per_sample=1e-5, module_s_per_step=1e-3)
    tables = [_table("table_wise", name=f"t{i}", owners=(i % 4,)) for i in range(8)]
    cluster = Cluster(4, 2, 100)
    plain, sparse, hybrid = (
        predict_step(tables, cluster, links, compute, p) for p in ("plain", "sparse_dist", "hybrid")
    )
    assert plain.total >= sparse.total >= hybrid.total
    assert plain.emb_fwd == sparse.emb_fwd == hybrid.emb_fwd  # compute is the same; only the waits differ
    assert sparse.total == pytest.approx(sparse.emb_fwd + sparse.emb_bwd + sparse.dense + sparse.comm_wait)
    with pytest.raises(ValueError, match="semi"):
        predict_step(tables, cluster, links, compute, "semi")


def test_an_unknown_sharding_type_is_named() -> None:
    with pytest.raises(ValueError, match="'t'.*grid_shard"):
        table_bytes(_table("grid_shard"), CLUSTER)


def test_between_hosts_the_replicated_sync_crosses_once_per_host() -> None:
    reads = torch.cat([torch.full((50,), 40.0, dtype=torch.float64), torch.full((950,), 0.01, dtype=torch.float64)])
    table = _table("het_row_replicated", reads=reads, hot=reads[:50], ids_per_sample=float(reads.sum()) / 800)
    flat = table_bytes(table, Cluster(8, 8, 100))
    two_hosts = table_bytes(table, Cluster(8, 4, 100))
    assert flat.inter_host == 0.0 and 0.0 < two_hosts.inter_host < two_hosts.total


def test_lookahead_hides_the_fresh_partials_under_sparse_dist_only() -> None:
    """A lookahead table's partials fly under the backward (``sparse_dist``), the stale ones (rows the
    previous step read) go again; a plain loop hides nothing and pays those twice; the fresh share falls
    as the cold rows get hotter."""
    from torchrec_het.planner.step_model import lookahead_fresh_share

    links, compute = Links(1e6, 1e6, 1e-4), Compute(lookup_s_per_id=1e-7, dense_s_per_sample=1e-4)
    reads = zipf_shares(1000, 1.05).double() * 400 * 6
    replicated = dict(hot=reads[:10], reads=reads, sync_every=1)
    on, off = _table("het_row_replicated", lookahead=True, **replicated), _table("het_row_replicated", **replicated)
    sparse_on, sparse_off = (predict_step([t], CLUSTER, links, compute, "sparse_dist") for t in (on, off))
    assert sparse_on.comm_wait < sparse_off.comm_wait
    stale = 1 - lookahead_fresh_share(on)  # their partial sums go early and again at the lookup
    assert sparse_on.bytes.emb_fwd == pytest.approx(sparse_off.bytes.emb_fwd * (1 + stale))
    plain_on, plain_off = (predict_step([t], CLUSTER, links, compute, "plain") for t in (on, off))
    assert plain_on.total > plain_off.total  # a plain loop hides nothing and sends the stale ones twice
    share = lookahead_fresh_share(on)
    assert 0 < share < 1
    hotter = _table("het_row_replicated", lookahead=True, hot=reads[:10], reads=reads * 10, sync_every=1)
    assert lookahead_fresh_share(hotter) < share


def test_an_exact_cache_is_priced_as_the_fetched_rows_tier() -> None:
    """Both bounds 0: the table runs as het_row_replicated's fetched-rows tier, so it is priced as
    a row_replicated table with no hot rows whose cold ids fetch rows: the same bytes, the tier's
    collectives (counts, ids; rows; their gradients) and its compute figure."""
    reads = torch.full((1000,), 0.5, dtype=torch.float64)
    exact = _table("het_cached_row_wise", reads=reads, hot=reads[:100])
    rows = _table("het_row_replicated", reads=reads, hot=reads[:0], cold_rows=True)
    assert exact.fetched_rows_tier and not _table("het_cached_row_wise", s_write=1).fetched_rows_tier
    assert (exact.priced_type, exact.setting) == ("het_row_replicated", rows.setting) == ("het_row_replicated", "rows")
    same = table_bytes(exact, CLUSTER), table_bytes(rows, CLUSTER)
    assert (same[0].ids, same[0].emb_fwd, same[0].emb_bwd) == pytest.approx(
        (same[1].ids, same[1].emb_fwd, same[1].emb_bwd)
    )
    assert plan_bytes([exact], CLUSTER).collectives == [2, 1, 1]
    bounded = plan_bytes([_table("het_cached_row_wise", reads=reads, hot=reads[:100], s_read=1)], CLUSTER)
    assert bounded.collectives == [3, 2, 2]  # ids and versions; rows and versions; pushes and their versions
