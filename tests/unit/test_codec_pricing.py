"""TorchRec's quantized comms priced: the planner's pricing, the step model and the bench's prediction
(torchrec_het.planner.qcomms, traffic.WirePrecision, step_model.with_codecs)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embedding import EmbeddingCollectionSharder
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
from torchrec.distributed.planner import Topology
from torchrec.distributed.planner.utils import build_sharder_data
from torchrec.distributed.types import CommOp, ParameterSharding

from torchrec_het.planner import AccessModel, HetEmbeddingEnumerator, PluginPricing, traffic, zipf_shares
from torchrec_het.planner.compute_costs import ComputeCosts
from torchrec_het.planner.cost_model import option_table
from torchrec_het.planner.pricing import priced_wire
from torchrec_het.planner.qcomms import comm_op, sharder_registry, wire_precision
from torchrec_het.planner.step_model import (
    Cluster,
    Compute,
    Links,
    PlannedTable,
    predict_step,
    table_bytes,
    with_codecs,
)
from torchrec_het.planner.traffic import FP32, TableLoad, WirePrecision
from torchrec_het.planner.whatif import compare, tables_from_configs
from torchrec_het.replication.memory import TierTopology
from torchrec_het.replication.profile import AccessProfile
from torchrec_het.sharders import HetEmbeddingBagCollectionSharder, HetEmbeddingCollectionSharder
from torchrec_het.sharding.common.wire_codec import codecs_of

HALF = WirePrecision(2.0, 2.0)  # fp16 forward, bf16 backward
HALF_SYNCED = WirePrecision(2.0, 2.0, 2.0)  # ... and row replication's replica syncs summed in bf16
STOCK_TYPES = ("table_wise", "column_wise", "table_column_wise", "row_wise")


@pytest.fixture(autouse=True)
def stated_codec_cpu(monkeypatch):
    """A codec's CPU as a stated figure (1 ns an element): these tests check how the model prices
    it, not what a loaded machine measured (under three test processes at once the measured fp16
    cost once outgrew the bytes it saves, and a shorter step read longer)."""
    from torchrec_het.sharding.common.wire_codec import WireCodec

    monkeypatch.setattr(WireCodec, "seconds_per_element", lambda self: 0.0 if self.codec is None else 1e-9)


def _registry(forward: str = "fp16", backward: str = "bf16") -> dict:
    config = QCommsConfig(forward_precision=CommType(forward), backward_precision=CommType(backward))
    return get_qcomm_codecs_registry(config)


def _load(ws: int = 4, **kw) -> TableLoad:
    return TableLoad(zipf_shares(1000, 1.1) * ws * 100 * 3, 200.0 * ws, 16, ws, **kw)


# --- which codec, how many bytes ------------------------------------------------------------


def test_each_type_takes_the_codecs_of_the_collective_its_embeddings_travel_by() -> None:
    pooled_a2a, rs, seq = (
        CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL,
        CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER,
        CommOp.SEQUENCE_EMBEDDINGS_ALL_TO_ALL,
    )
    for kind in ("table_wise", "column_wise", "table_column_wise", "het_row_replicated", "het_cached_row_wise"):
        assert comm_op(kind) == pooled_a2a, kind
    assert comm_op("row_wise") == comm_op("table_row_wise") == rs
    for kind in ("table_wise", "row_wise", "column_wise", "het_row_replicated"):
        assert comm_op(kind, pooled=False) == seq, kind
    assert comm_op("data_parallel") is None


def test_fp16_bf16_is_two_bytes_each_way_and_no_registry_is_fp32() -> None:
    registry = _registry()
    for kind in STOCK_TYPES + ("het_cached_row_wise",):
        assert wire_precision(registry, kind) == HALF, kind
        assert wire_precision(None, kind) == wire_precision({}, kind) == FP32 == WirePrecision(4.0, 4.0, 4.0)
    assert wire_precision(registry, "het_row_replicated") == wire_precision(registry, "het_row_replicated", False)
    assert wire_precision(registry, "het_row_replicated") == HALF_SYNCED  # the summing codec's bf16
    assert wire_precision(registry, "data_parallel") == FP32  # its all-reduce is not quantized


def test_replica_syncs_sum_in_bf16_or_fp16_only() -> None:
    """The replica syncs take the summing collective's backward codec where it can be summed as sent:
    fp16 / bf16; INT8 keeps them fp32, MX4 (TorchRec falls back to fp16 / bf16 there) does not."""
    assert wire_precision(_registry("int8", "int8"), "het_row_replicated").sync == 4.0
    assert wire_precision(_registry("fp16", "fp16"), "het_row_replicated").sync == 2.0
    assert wire_precision(_registry("mx4", "mx4"), "het_row_replicated").sync == 2.0


def test_int8_prices_its_row_scale_and_bias() -> None:
    """FBGEMM's row-wise INT8: ``row_dim`` bytes, then an fp32 scale and bias, per ``row_dim`` values."""
    registry = _registry("int8", "int8")
    codec = registry[CommOp.POOLED_EMBEDDINGS_ALL_TO_ALL.name].forward
    row_dim = codec.create_context().row_dim
    per_element = (row_dim + 8) / row_dim
    assert wire_precision(registry, "table_wise") == WirePrecision(per_element, per_element)
    load = _load()
    fp32, int8 = traffic.table_wise_bytes(load), traffic.table_wise_bytes(load, WirePrecision(per_element, per_element))
    assert int8.ids == fp32.ids
    assert int8.forward - int8.ids == pytest.approx((fp32.forward - fp32.ids) * per_element / 4)
    assert int8.backward == pytest.approx(fp32.backward * per_element / 4)


def test_the_sharder_of_the_tables_module_gives_the_registry() -> None:
    bags, sequences = _registry(), _registry("bf16", "bf16")
    sharders = [
        EmbeddingCollectionSharder(qcomm_codecs_registry=sequences),
        EmbeddingBagCollectionSharder(qcomm_codecs_registry=bags),
    ]
    assert sharder_registry(sharders, pooled=True) is bags
    assert sharder_registry(sharders, pooled=False) is sequences
    assert sharder_registry([HetEmbeddingBagCollectionSharder(qcomm_codecs_registry=bags)], pooled=True) is bags
    assert sharder_registry([HetEmbeddingCollectionSharder()], pooled=True) is None
    assert sharder_registry(None) is None


# --- what halves, what does not ----------------------------------------------------------------


def _embeddings(b: traffic.Bytes) -> tuple[float, float]:
    return b.forward - b.ids, b.backward


def test_fp16_halves_stock_embeddings_not_their_ids() -> None:
    for price in (traffic.table_wise_bytes, traffic.row_wise_bytes):
        fp32, half = price(_load(weighted=True)), price(_load(weighted=True), HALF)
        assert half.ids == fp32.ids > 0
        assert _embeddings(half) == pytest.approx(tuple(x / 2 for x in _embeddings(fp32)))


def test_fp16_halves_row_replications_partial_sums_not_ids() -> None:
    for load, hot, host in ((_load(), 50, 0), (_load(8, topology=TierTopology(8, 4, 1.0, 1.0)), 20, 30)):
        fp32 = traffic.row_replicated_bytes(load, hot, 2, host)
        half = traffic.row_replicated_bytes(load, hot, 2, host, HALF)  # its syncs summed in fp32
        assert half.ids == fp32.ids > 0 and half.sync == fp32.sync > 0
        assert half.forward - half.ids == pytest.approx((fp32.forward - fp32.ids) / 2)
        if host:  # the per-host tier's reads halve; each host's summed gradient to the others' holders does not
            combine = 2 * half.backward - fp32.backward  # what is left when the quantized part halves
            touched = float((1.0 - torch.exp(-load.reads[hot : hot + host] / 2)).sum())
            assert combine == pytest.approx(2 * touched * (16 * 4 + traffic.ID))  # 2 hosts, each to the other
            assert half.intra_forward < fp32.intra_forward
        else:
            assert half.backward == pytest.approx(fp32.backward / 2)
    sequences = traffic.sequence_replicated_bytes(_load(), 50), traffic.sequence_replicated_bytes(_load(), 50, 1, HALF)
    assert sequences[1].ids == sequences[0].ids and sequences[1].sync == sequences[0].sync
    assert _embeddings(sequences[1]) == pytest.approx(tuple(x / 2 for x in _embeddings(sequences[0])))


def test_a_bf16_sync_halves_the_summed_gradients_not_the_touch_counts() -> None:
    hot_often, hot_rarely = torch.full((50,), 5.0, dtype=torch.float64), torch.full((50,), 0.01, dtype=torch.float64)
    for hosts in (1, 2):
        # most rows touched: one all-reduce of gradients and touch counts, all in the summing dtype
        dense = (
            traffic.replica_sync_bytes(hot_often, 16, 8, hosts),
            traffic.replica_sync_bytes(hot_often, 16, 8, hosts, 1, 2.0),
        )
        if hosts == 1:
            assert dense[1][0] == pytest.approx(dense[0][0] / 2)
        else:  # the leaders' bit masks and ids do not halve
            assert dense[0][0] / 2 < dense[1][0] < dense[0][0] and dense[1][1] == pytest.approx(dense[0][1] / 2)
    # few rows touched: the touch counts' all-reduce (fp32), then the touched rows' gradients (bf16)
    sparse = traffic.replica_sync_bytes(hot_rarely, 16, 8), traffic.replica_sync_bytes(hot_rarely, 16, 8, 1, 1, 2.0)
    counts = 2 * 7 * 50 * 4
    assert sparse[1][0] - counts == pytest.approx((sparse[0][0] - counts) / 2)
    # in the traffic model: the sync and the per-host combine, never the ids
    load = _load(8, topology=TierTopology(8, 4, 1.0, 1.0))
    fp32, half = (
        traffic.row_replicated_bytes(load, 20, 1, 30),
        traffic.row_replicated_bytes(load, 20, 1, 30, HALF_SYNCED),
    )
    assert half.ids == fp32.ids and half.sync < fp32.sync
    touched = float((1 - torch.exp(-load.reads[20:50] / 2)).sum())  # per-host rows a host touches, 2 hosts
    assert half.backward == pytest.approx(fp32.backward / 2 + touched * traffic.ID)  # each combine's id stays


def test_fp16_halves_the_caches_rows_not_its_ids_versions_or_pushed_ids() -> None:
    fp32, half = traffic.cached_bytes(_load(), 100, 1, 1), traffic.cached_bytes(_load(), 100, 1, 1, wire=HALF)
    assert half.ids == fp32.ids > 0
    assert half.forward - half.ids == pytest.approx((fp32.forward - fp32.ids) / 2)
    # a pushed row: its gradient halves, its int64 id does not
    pushes = fp32.backward / (16 * 4 + traffic.ID)
    assert half.backward == pytest.approx(pushes * (16 * 2 + traffic.ID))


# --- no registry: today's figures, to the byte --------------------------------------------------

# (forward, backward, sync, ids) as the traffic model priced them before codecs were priced
TODAY_TRAFFIC = {
    "replicated": (19922.49513278322, 17669.1804015714, 20400.0, 2253.3147312118194),
    "replicated_s3": (21049.15249838913, 17669.1804015714, 6800.0, 3379.972096817729),
    "replicated_hosts": (61726.15257863738, 59058.890390005254, 27221.88791644751, 6904.471161774649),
    "sequences": (18250.76787546282, 16222.904778189173, 20400.0, 2027.8630972736466),
    "cached": (32646.96744021578, 26711.155178358364, 0.0, 8903.718392786122),
    "cached_stale": (17289.753142638925, 18829.870600573104, 0.0, 4715.387220719707),
    "row_wise": (174000.0, 153600.0, 0.0, 20400.0),
    "table_wise": (48000.0, 38400.0, 0.0, 9600.0),
}
TODAY_PLAN_BYTES = (118434.4652020146, 880142.6876155499, 1854405.9547712852, 1594367.053010124)
# comm_wait: the phases cross hosts in the share of the plan's inter-host bytes (the per-host tier's
# bytes stay in a host), no longer in the even spread over peers
TODAY_STEP = (0.00524, 0.00048, 0.001, 0.003183069715401238)


def test_without_a_registry_the_traffic_model_prices_as_before() -> None:
    load = TableLoad(zipf_shares(1000, 1.1) * 4 * 100 * 3, 800.0, 16, 4)
    weighted = TableLoad(load.reads, 800.0, 16, 4, weighted=True)
    hosts = TableLoad(zipf_shares(1000, 1.1) * 8 * 100 * 3, 1600.0, 16, 8, TierTopology(8, 4, 1.0, 1.0))
    cases = {
        "replicated": traffic.row_replicated_bytes(load, 50),
        "replicated_s3": traffic.row_replicated_bytes(weighted, 50, 3),
        "replicated_hosts": traffic.row_replicated_bytes(hosts, 20, 1, 30),
        "sequences": traffic.sequence_replicated_bytes(load, 50),
        "cached": traffic.cached_bytes(load, 100, 0, 0),
        "cached_stale": traffic.cached_bytes(load, 100, 2, 2, "other"),
        "row_wise": traffic.row_wise_bytes(weighted),
        "table_wise": traffic.table_wise_bytes(load),
    }
    for name, b in cases.items():
        assert (b.forward, b.backward, b.sync, b.ids) == pytest.approx(TODAY_TRAFFIC[name], rel=1e-12), name


def _plan(sharders=None) -> list[PlannedTable]:
    reads = zipf_shares(1000, 1.1) * 8 * 100 * 3
    common = dict(rows=1000, dim=16, features=2, ids_per_sample=3.0, reads=reads)
    tables = [
        PlannedTable("tw", sharding_type="table_wise", owners=(1,), **common),
        PlannedTable("rw", sharding_type="row_wise", **common),
        PlannedTable("dp", sharding_type="data_parallel", **common),
        PlannedTable("hr", sharding_type="het_row_replicated", hot=reads[:40], per_host=reads[40:60], **common),
        PlannedTable("hc", sharding_type="het_cached_row_wise", hot=reads[:100], s_read=1, s_write=1, **common),
    ]
    return [with_codecs(t, sharders) for t in tables]


CLUSTER, LINKS = Cluster(8, 4, 100), Links(1e9, 1e8, 1e-4)
COMPUTE = Compute(lookup_s_per_id=2e-7, dense_s_per_sample=1e-5, module_s_per_step=1e-3)


def test_without_a_registry_the_step_model_predicts_as_before() -> None:
    for sharders in (None, [EmbeddingBagCollectionSharder()], [HetEmbeddingBagCollectionSharder()]):
        step = predict_step(_plan(sharders), CLUSTER, LINKS, COMPUTE, "sparse_dist", dense_params=10_000)
        b = step.bytes
        assert (b.ids, b.emb_fwd, b.emb_bwd, b.inter_host) == pytest.approx(TODAY_PLAN_BYTES, rel=1e-12)
        assert (step.emb_fwd, step.emb_bwd, step.dense, step.comm_wait) == pytest.approx(TODAY_STEP, rel=1e-12)


# --- the step model and the bench's prediction ---------------------------------------------------


def test_the_step_model_halves_every_types_embeddings_not_ids_or_data_parallel() -> None:
    fp32 = [table_bytes(t, CLUSTER) for t in _plan()]
    half = [
        table_bytes(t, CLUSTER) for t in _plan([HetEmbeddingBagCollectionSharder(qcomm_codecs_registry=_registry())])
    ]
    for table, a, b in zip(_plan(), fp32, half):
        assert b.ids == a.ids, table.name
        if table.sharding_type == "data_parallel":
            assert (b.emb_fwd, b.emb_bwd) == (a.emb_fwd, a.emb_bwd)
        else:
            assert b.emb_fwd == pytest.approx(a.emb_fwd / 2), table.name
            assert b.emb_bwd < a.emb_bwd, table.name
    tw, rw = half[0], half[1]
    assert (tw.emb_bwd, rw.emb_bwd) == pytest.approx((fp32[0].emb_bwd / 2, fp32[1].emb_bwd / 2))


def test_the_quantized_twin_steps_faster_where_the_link_is_the_bottleneck() -> None:
    reads = zipf_shares(20_000, 1.1) * 2 * 1024
    tables = [PlannedTable(f"t{i}", 20_000, 64, 1, 1.0, "table_wise", reads=reads, owners=(i % 2,)) for i in range(26)]
    sharders = [EmbeddingBagCollectionSharder(qcomm_codecs_registry=_registry())]
    slow, compute = Links(1.25e9 / 8, 1.25e9 / 8), Compute(lookup_s_per_id=1e-7, dense_s_per_sample=1e-5)
    for pipeline in ("plain", "sparse_dist", "hybrid"):
        fp32 = predict_step(tables, Cluster(2, 2, 1024), slow, compute, pipeline)
        fp16 = predict_step([with_codecs(t, sharders) for t in tables], Cluster(2, 2, 1024), slow, compute, pipeline)
        assert fp16.bytes.emb_fwd == pytest.approx(fp32.bytes.emb_fwd / 2) and fp16.bytes.ids == fp32.bytes.ids
        assert fp16.total < fp32.total, pipeline
    one_rank = [
        predict_step(t, Cluster(1, 1, 1024), slow, compute).total
        for t in (tables, [with_codecs(t, sharders) for t in tables])
    ]
    assert one_rank[0] == one_rank[1]  # nothing crosses ranks: the codecs change nothing


def test_the_whatif_prices_its_plans_under_the_sharders_codecs() -> None:
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=32, num_embeddings=20_000, feature_names=[f"f{i}"])
        for i in range(4)
    ]
    shapes, cluster, links = tables_from_configs(configs, 512, 1.2), Cluster(8, 4, 512), Links(1e10, 1e8, 1e-4)
    fp32 = compare(shapes, cluster, links, COMPUTE, (0,))
    half = compare(
        shapes,
        cluster,
        links,
        COMPUTE,
        (0,),
        sharders=[HetEmbeddingBagCollectionSharder(qcomm_codecs_registry=_registry())],
    )
    assert all(
        t.wire == (HALF_SYNCED if t.sharding_type == "het_row_replicated" else HALF) for p in half for t in p.tables
    )
    for a, b in zip(fp32, half):
        assert b.prediction.total < a.prediction.total, a.label


def _profile(names: list[str], rows: int, ws: int, batch: int) -> AccessProfile:
    counts = tuple((zipf_shares(rows, 1.1) * ws * batch).floor().long() for _ in names)
    return AccessProfile(tuple(names), (rows,) * len(names), counts, 1)


def test_the_bench_predicts_stock_table_wise_fp16_with_its_codecs() -> None:
    """``stock_table_wise_fp16``'s sharders (fp16 forward, bf16 backward): half ``stock_table_wise``'s
    embedding bytes, the same ids, a shorter step."""
    from torchrec_het_bench.configs import CONFIGS
    from torchrec_het_bench.prediction import ModelInputs, predict_entry

    ws, batch, rows = 2, 256, 5000
    configs = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=32, num_embeddings=rows, feature_names=[f"f{i}"])
        for i in range(4)
    ]
    plan = {c.name: ParameterSharding("table_wise", "fused", ranks=[i % ws]) for i, c in enumerate(configs)}
    compute = Compute(lookup_s_per_id=1e-7, dense_s_per_sample=1e-6)
    inputs = ModelInputs(_profile([c.name for c in configs], rows, ws, batch), Links(1.5e8, 1.5e8), compute, 0)
    spec = SimpleNamespace(world_size=ws, local_world_size=ws)
    predicted = {}
    for name in ("stock_table_wise", "stock_table_wise_fp16"):
        model = SimpleNamespace(sharders=CONFIGS[name].make_sharders(), modules=lambda: [])
        sharded = SimpleNamespace(model=model, plan=SimpleNamespace(plan={"": plan}))
        predicted[name] = predict_entry(sharded, configs, inputs, spec, "sparse_dist", batch)
    fp32, fp16 = (predicted[n]["bytes_per_step"] for n in ("stock_table_wise", "stock_table_wise_fp16"))
    assert fp16["fwd_ids"] == fp32["fwd_ids"] > 0
    assert (fp16["fwd_emb"], fp16["bwd_grad"]) == pytest.approx((fp32["fwd_emb"] / 2, fp32["bwd_grad"] / 2), abs=1)
    assert predicted["stock_table_wise_fp16"]["step_ms"]["total"] < predicted["stock_table_wise"]["step_ms"]["total"]


# --- the plugin's planner against TorchRec's estimator -------------------------------------------

SIZES = {"small": 2000, "mid": 100_000}


def _options(registry: dict | None) -> tuple[dict, PluginPricing]:
    """The enumerated options of a Zipf-profiled model under ``registry`` on 4 ranks, and their pricing."""
    counts = tuple((zipf_shares(rows, 1.1) * 512 * 10).floor().long() for rows in SIZES.values())
    profile = AccessProfile(tuple(SIZES), tuple(SIZES.values()), counts, 10)
    pricing = PluginPricing(AccessModel(profile), compute=ComputeCosts.bytes_only())
    topology = Topology(world_size=4, local_world_size=4, compute_device="cpu")
    enumerator = HetEmbeddingEnumerator(topology, 512, pricing=pricing)
    tables = [
        EmbeddingBagConfig(name=n, feature_names=[f"f_{n}"], embedding_dim=32, num_embeddings=r)
        for n, r in SIZES.items()
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    sharder = HetEmbeddingBagCollectionSharder(qcomm_codecs_registry=registry)
    return {(o.name, o.sharding_type): o for o in enumerator.enumerate(ebc, [sharder])}, pricing


def test_the_planner_prices_plugin_options_under_the_sharders_codecs() -> None:
    (fp32, pricing), (half, _) = _options(None), _options(_registry())
    for name in SIZES:
        for kind in ("het_row_replicated", "het_cached_row_wise"):
            a, b = fp32[(name, kind)], half[(name, kind)]
            assert priced_wire(a) == FP32 and priced_wire(b) == (HALF_SYNCED if kind == "het_row_replicated" else HALF)
            # the bytes the planner's model gives the options (the step model's, from the option's table)
            bytes_a, bytes_b = (
                table_bytes(option_table(o, pricing, 4, None, None), Cluster(4, 4, 512)) for o in (a, b)
            )
            assert bytes_b.ids == bytes_a.ids
            if kind == "het_row_replicated":  # its gradients in bf16; its replica syncs' in bf16, touch counts in fp32
                assert bytes_a.emb_bwd / 2 <= bytes_b.emb_bwd < bytes_a.emb_bwd
            assert bytes_b.emb_fwd == pytest.approx(bytes_a.emb_fwd / 2)
            # the step model prices the option: less to wait for under the codecs, the same compute and
            # the codecs' CPU (every coded element encoded and decoded, the 4 ranks sharing them)
            perf_a, perf_b = a.shards[0].perf, b.shards[0].perf
            assert perf_b.fwd_comms + perf_b.bwd_comms < perf_a.fwd_comms + perf_a.bwd_comms, (name, kind)
            wire = priced_wire(b)
            assert wire.forward_cpu > 0 and wire.backward_cpu > 0
            coded = bytes_b.emb_fwd / wire.forward * wire.forward_cpu / 4
            assert perf_b.fwd_compute - perf_a.fwd_compute == pytest.approx(1e3 * coded, rel=1e-6)
            coded = (bytes_b.emb_bwd - bytes_b.sync) / wire.backward * wire.backward_cpu / 4
            assert perf_b.bwd_compute - perf_a.bwd_compute == pytest.approx(1e3 * coded, rel=1e-6)


def test_stock_options_halve_as_torchrecs_estimator_and_the_step_model_price_them() -> None:
    """TorchRec prices a stock option's output comms at its codecs' dtype sizes (fp16 / bf16: 2 bytes);
    the planner's one model (the step model) halves the same embeddings, and a stock option waits less."""
    (fp32, _), (half, _) = _options(None), _options(_registry())
    for name in SIZES:
        for kind in STOCK_TYPES:
            a, b = fp32[(name, kind)].shards[0].perf, half[(name, kind)].shards[0].perf
            assert b.fwd_comms + b.bwd_comms < a.fwd_comms + a.bwd_comms, (name, kind)
    sizes = build_sharder_data(EmbeddingBagCollectionSharder(qcomm_codecs_registry=_registry())).qcomm_dtype_sizes
    for kind in STOCK_TYPES:
        op = comm_op(kind)
        wire = wire_precision(_registry(), kind)
        assert sizes[op.name] == (wire.forward, wire.backward), kind
        assert codecs_of(_registry(), op).name == "fp16/bf16"
    table = PlannedTable("t", 1000, 32, 1, 1.0, "table_wise", owners=(0,))
    sharders = [EmbeddingBagCollectionSharder(qcomm_codecs_registry=_registry())]
    step_fp32, step_half = (
        table_bytes(table, Cluster(4, 4, 512)),
        table_bytes(with_codecs(table, sharders), Cluster(4, 4, 512)),
    )
    assert (step_half.emb_fwd / step_fp32.emb_fwd, step_half.emb_bwd / step_fp32.emb_bwd) == pytest.approx((0.5, 0.5))


def test_the_step_model_prices_a_codecs_cpu_in_the_phase_it_codes() -> None:
    reads = zipf_shares(20_000, 1.1) * 2 * 1024
    fast, compute = Links(1e12, 1e12), Compute(lookup_s_per_id=1e-7, dense_s_per_sample=1e-5)
    cluster = Cluster(2, 2, 1024)
    plain = [PlannedTable(f"t{i}", 20_000, 64, 1, 1.0, "table_wise", reads=reads, owners=(i % 2,)) for i in range(4)]
    costly = WirePrecision(2.0, 2.0, 4.0, forward_cpu=3e-8, backward_cpu=1e-8)  # a slow codec on a fast link
    coded = [dataclasses.replace(t, wire=costly) for t in plain]
    a, b = (predict_step(t, cluster, fast, compute, "plain") for t in (plain, coded))
    elements = b.bytes.emb_fwd / 2.0  # summed over ranks; each rank encodes and decodes its share
    assert b.emb_fwd - a.emb_fwd == pytest.approx(elements * 3e-8 / 2)
    assert b.emb_bwd - a.emb_bwd == pytest.approx(b.bytes.emb_bwd / 2.0 * 1e-8 / 2)
    assert b.total > a.total  # on a fast link the codec costs more than the bytes it saves
    assert costly == WirePrecision(2.0, 2.0, 4.0)  # precisions compare by their bytes
