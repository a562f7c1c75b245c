"""The plugin lookups' compute in the planner's perf estimate: the stored calibration
(``torchrec_het/planner/compute_costs.json``), how it scales with a table's ids, the golden
plans it gives, and the table's loading and regeneration (``python -m torchrec_het_bench.calibrate``).
"""

import json
import logging
import math
import subprocess
import sys

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner import ParameterConstraints, Topology

from torchrec_het.config import CacheSettings, HetCacheConfig
from torchrec_het.planner import (
    AccessModel,
    HetEmbeddingEnumerator,
    HetEmbeddingShardingPlanner,
    PluginPricing,
    zipf_shares,
)
from torchrec_het.planner.compute_costs import COSTS_PATH, VERSION, ComputeCosts, load_compute_costs
from torchrec_het.planner.planner import cpu_network
from torchrec_het.planner.pricing import priced_options
from torchrec_het.planner.step_model import Compute
from torchrec_het.replication.config import ReplicationConfig
from torchrec_het.replication.profile import AccessProfile
from torchrec_het.sharders import HetEmbeddingBagCollectionSharder
from torchrec_het_bench.calibrate import costs_from_micro

BATCH = 512
CPU_LIKE = Compute(lookup_s_per_id=2e-7, dense_s_per_sample=0.0)  # stated lookups, no dense part: bytes against lookups
STORED = json.loads(COSTS_PATH.read_text())  # read here independently of the loader
PER_ID = STORED["extra_seconds_per_id"]


@pytest.fixture(autouse=True)
def _quiet(caplog):
    caplog.set_level(logging.ERROR)


def _ebc(sizes: dict[str, int], dim: int = 32) -> EmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(name=n, feature_names=[f"f_{n}"], embedding_dim=dim, num_embeddings=r)
        for n, r in sizes.items()
    ]
    return EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


def _uniform_profile(rows: int = 100_000, batches: int = 10) -> AccessProfile:
    """One table "u", BATCH one-hot reads per batch, every read row read once: no row is hot."""
    counts = torch.zeros(rows, dtype=torch.int64)
    counts[: BATCH * batches] = 1
    return AccessProfile(("u",), (rows,), (counts,), batches)


def _plan(
    ebc, pricing: PluginPricing, world_size: int = 2, local_world_size: int = 2, constraints=None, **bandwidths
) -> dict:
    topology = Topology(world_size=world_size, local_world_size=local_world_size, compute_device="cpu", **bandwidths)
    planner = HetEmbeddingShardingPlanner(
        topology=topology, batch_size=BATCH, pricing=pricing, constraints=constraints, compute=CPU_LIKE
    )
    plan = planner.plan(ebc, [HetEmbeddingBagCollectionSharder()]).plan[""]
    return {n: (p.sharding_type, p.ranks if len(p.ranks) < world_size else "all") for n, p in plan.items()}


def _options(ebc, pricing: PluginPricing, world_size: int = 2, compute_device: str = "cpu", sharder=None) -> dict:
    topology = cpu_network(Topology(world_size=world_size, local_world_size=world_size, compute_device=compute_device))
    enumerator = HetEmbeddingEnumerator(topology, BATCH, pricing=pricing)
    sharders = [sharder or HetEmbeddingBagCollectionSharder()]
    return {(o.name, o.sharding_type): o for o in enumerator.enumerate(ebc, sharders)}


def _compute(option) -> float:
    return sum(s.perf.fwd_compute + s.perf.bwd_compute for s in option.shards) / len(option.shards)


# --- golden plans ---------------------------------------------------------------------------


def test_a_uniform_profile_is_not_planned_row_replicated_with_no_hot_rows() -> None:
    """A profiled table whose reads are uniform has no hot row. With the stored compute (1 id per
    sample, 512 per rank, times the exact replicated figure) it costs more than row_wise's, so the
    plan is TorchRec's own (table_wise: TorchRec's bag sharder offers no row_wise on CPU); where the
    constraints allow row_wise, the search's row_wise."""
    ebc, profile = _ebc({"u": 100_000}), _uniform_profile()
    priced = PluginPricing(AccessModel(profile))
    options = _options(ebc, priced)
    replicated, row_wise = options[("u", "het_row_replicated")], options[("u", "row_wise")]
    assert priced.hot_rows(priced.load(replicated, 2), priced_options(replicated)) == 0
    assert replicated.total_perf > row_wise.total_perf
    assert _plan(ebc, priced) == {"u": ("table_wise", [0])}
    forced = {"u": ParameterConstraints(sharding_types=["row_wise", "het_row_replicated"])}
    assert _plan(ebc, priced, constraints=forced) == {"u": ("row_wise", "all")}


SIZES = {"tiny": 40, "small": 2000, "mid": 100_000, "big": 1_000_000, "cold": 300_000}
HR_ALL, DP_ALL = ("het_row_replicated", "all"), ("data_parallel", "all")

# every table profiled (Zipf 1.1), priced with the stored compute and stated lookups: at 2 GB/s the
# plugin's lookups cost about what the bytes they save do on one host (TorchRec's own plan kept:
# not faster by more than the model's error); across hosts at 2 GB/s / 250 MB/s,
# or on one host at 200 MB/s, the bytes win
GOLDEN_COMPUTE_PRICED = {
    (2, 2, 2e6): {"tiny": DP_ALL, "small": ("table_wise", [1]), "mid": ("table_wise", [0]),
                  "big": ("table_wise", [0]), "cold": ("table_wise", [1])},
    (8, 8, 2e6): {"tiny": ("table_wise", [4]), "small": ("table_wise", [3]), "mid": ("table_wise", [2]),
                  "big": ("table_wise", [0]), "cold": ("table_wise", [1])},
    (8, 4, 2e6): {"tiny": DP_ALL, "small": HR_ALL, "mid": HR_ALL, "big": HR_ALL, "cold": HR_ALL},
    (2, 2, 2e5): {"tiny": DP_ALL, "small": HR_ALL, "mid": HR_ALL, "big": HR_ALL, "cold": HR_ALL},
    (8, 8, 2e5): {"tiny": DP_ALL, "small": HR_ALL, "mid": HR_ALL, "big": HR_ALL, "cold": HR_ALL},
}  # fmt: skip


@pytest.mark.parametrize("world_size,local_world_size,bandwidth", sorted(GOLDEN_COMPUTE_PRICED), ids=str)
def test_golden_plans_priced_with_the_stored_compute(world_size: int, local_world_size: int, bandwidth: float) -> None:
    counts = tuple((zipf_shares(r, 1.1) * BATCH * 10).floor().long() for r in SIZES.values())
    pricing = PluginPricing(AccessModel(AccessProfile(tuple(SIZES), tuple(SIZES.values()), counts, 10)))
    plan = _plan(
        _ebc(SIZES), pricing, world_size, local_world_size, intra_host_bw=bandwidth, inter_host_bw=bandwidth / 8
    )
    assert plan == GOLDEN_COMPUTE_PRICED[(world_size, local_world_size, bandwidth)]


# --- the compute term -----------------------------------------------------------------------


@pytest.mark.parametrize("sync,bound,cls", [(1, 0, "exact"), (10, 10, "stale")])
def test_plugin_perf_includes_the_stored_cost_per_id_times_the_ids_per_rank(sync: int, bound: int, cls: str) -> None:
    sizes = {"a": 50_000, "b": 20_000}
    counts = (torch.full((50_000,), 3 * 4 * BATCH // 50_000 + 1), torch.full((20_000,), 1))  # ~3 and ~1 ids per sample
    profile = AccessProfile(tuple(sizes), tuple(sizes.values()), counts, 4)
    cache = HetCacheConfig(default=CacheSettings(s_read=bound, s_write=bound))
    pricing = PluginPricing(AccessModel(profile))  # the settings are the sharder's, in each option's plan options
    sharder = HetEmbeddingBagCollectionSharder(cache=cache, replication=ReplicationConfig(replica_sync_every=sync))
    options = _options(_ebc(sizes), pricing, sharder=sharder)
    for name in sizes:
        twin = options[(name, "row_wise")]
        ids_per_rank = BATCH * sum(twin.input_lengths)
        assert ids_per_rank == pytest.approx(
            float(counts[list(sizes).index(name)].sum()) / 4
        )  # the profile's reads per batch
        for sharding_type in ("het_cached_row_wise", "het_row_replicated"):
            option = options[(name, sharding_type)]
            priced = (
                ("het_row_replicated", "rows") if (sharding_type, cls) == ("het_cached_row_wise", "exact") else None
            )
            extra_ms = PER_ID[priced[0]][priced[1]] if priced else PER_ID[sharding_type][cls]
            extra_ms *= ids_per_rank * 1e3  # an exact cache is priced as the fetched-rows tier it runs as
            for shard, base in zip(option.shards, twin.shards):
                base_total = base.perf.fwd_compute + base.perf.bwd_compute
                total = shard.perf.fwd_compute + shard.perf.bwd_compute
                assert total == pytest.approx(max(base_total + extra_ms, 0.0)), (name, sharding_type)
                assert shard.perf.fwd_compute / total == pytest.approx(
                    base.perf.fwd_compute / base_total
                )  # the twin's split


def test_the_stored_figures_are_what_the_estimate_adds() -> None:
    """512 one-hot ids per rank of an exact het_row_replicated table: the stored figure x 512, in ms."""
    ebc = _ebc({"u": 100_000})
    options = _options(ebc, PluginPricing(AccessModel(_uniform_profile())))
    extra = _compute(options[("u", "het_row_replicated")]) - _compute(options[("u", "row_wise")])
    assert extra == pytest.approx(PER_ID["het_row_replicated"]["exact"] * 512 * 1e3)
    assert extra > 0.1  # ms: about 0.46 us per id as measured (compute_costs.json, revision 2)


def test_a_cheaper_lookup_lowers_compute_but_never_below_zero() -> None:
    cheap = ComputeCosts({t: {"exact": -1.0, "stale": -1.0} for t in ("het_cached_row_wise", "het_row_replicated")})
    options = _options(_ebc({"u": 100_000}), PluginPricing(AccessModel(_uniform_profile()), compute=cheap))
    for sharding_type in ("het_cached_row_wise", "het_row_replicated"):
        assert all(s.perf.fwd_compute == 0.0 == s.perf.bwd_compute for s in options[("u", sharding_type)].shards)


def test_a_device_the_table_was_not_measured_on_gets_no_extra() -> None:
    def extra(pricing: PluginPricing, device: str) -> float:
        options = _options(_ebc({"u": 100_000}), pricing, compute_device=device)
        return _compute(options[("u", "het_row_replicated")]) - _compute(options[("u", "row_wise")])

    measured = PluginPricing(AccessModel(_uniform_profile()))
    assert extra(measured, "cpu") > 0
    assert extra(measured, "cuda") == 0.0
    assert extra(PluginPricing(AccessModel(_uniform_profile()), compute=ComputeCosts.bytes_only()), "cpu") == 0.0


# --- the stored table -----------------------------------------------------------------------


def test_the_stored_table_loads_with_its_version_and_fields() -> None:
    assert STORED["version"] == VERSION == 2  # figures against table_wise
    assert STORED["reference"] == "table_wise" and STORED["revision"] >= 2
    assert STORED["device"] == "cpu"
    assert STORED["measured_with"].startswith("python -m torchrec_het_bench.micro")
    assert STORED["measured_on"] and STORED["preset"] and STORED["ids_per_step_per_rank"] > 0
    costs = load_compute_costs()
    assert costs.source == str(COSTS_PATH) and costs.device == "cpu"
    for sharding_type in ("het_cached_row_wise", "het_row_replicated"):
        for cls in ("exact", "stale"):
            assert costs.per_id(sharding_type, cls) == PER_ID[sharding_type][cls]
            assert math.isfinite(costs.per_id(sharding_type, cls))
    assert PluginPricing().compute == costs  # the default pricing uses it


def _write(tmp_path, doc) -> str:
    path = tmp_path / "costs.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("change,message", [
    (lambda d: d.pop("version"), "has no 'version' field"),
    (lambda d: d.update(version=1), "has version 1, this torchrec_het reads version 2"),
    (lambda d: d.update(version="1"), "has version '1'"),
    (lambda d: d.pop("measured_with"), "lacks the field 'measured_with'"),
    (lambda d: d["extra_seconds_per_id"]["het_row_replicated"].pop("stale"), r"\['het_row_replicated'\]\['stale'\] must be a finite number"),
    (lambda d: d["extra_seconds_per_id"]["het_cached_row_wise"].update(exact="fast"), "must be a finite number, got 'fast'"),
])  # fmt: skip
def test_a_malformed_table_raises_naming_the_file(tmp_path, change, message) -> None:
    doc = json.loads(COSTS_PATH.read_text())
    change(doc)
    path = _write(tmp_path, doc)
    with pytest.raises(ValueError, match=message) as raised:
        load_compute_costs(path)
    assert repr(path) in str(raised.value)


def test_a_missing_or_unreadable_table_raises_naming_the_file(tmp_path) -> None:
    for path in (str(tmp_path / "absent.json"), _write(tmp_path, "{not json")):
        with pytest.raises(ValueError, match="cannot be read") as raised:
            load_compute_costs(path)
        assert repr(path) in str(raised.value)


# --- regeneration ---------------------------------------------------------------------------


def _micro(ids: float | None = 1000.0) -> dict:
    def entry(name, sharding_type, ms, **params):
        return {"name": name, "sharding_types": [sharding_type], "params": params, "ms_per_step": {"median": ms}}

    doc = {
        "preset": "smoke", "world_size": 2, "tables": 4, "embedding_dim": 16, "batch_size_per_rank": 100, "alpha": 1.1,
        "embedding_optimizer": "rowwise_adagrad",
        "types": [
            entry("table_wise", "table_wise", 9.0), entry("row_wise", "row_wise", 10.0),
            entry("het_cached_s0", "het_cached_row_wise", 14.0, s_read=0, s_write=0),
            entry("het_cached_s10", "het_cached_row_wise", 12.0, s_read=10, s_write=10),
            entry("het_replicated_s1", "het_row_replicated", 11.0, replica_sync_every=1),
            entry("het_replicated_s10", "het_row_replicated", 8.5, replica_sync_every=10),
        ],
    }  # fmt: skip
    if ids is not None:
        doc["ids_per_step_per_rank"] = ids
    return doc


def test_costs_from_micro_are_ms_beyond_table_wise_per_id() -> None:
    table = costs_from_micro(_micro(), "python -m torchrec_het_bench.micro --preset smoke", "2026-01-02")
    assert table["version"] == 2 and table["measured_on"] == "2026-01-02" and table["preset"] == "smoke"
    assert table["reference"] == "table_wise" and table["reference_ms_per_step"] == 9.0  # not row_wise's 10
    assert table["extra_seconds_per_id"] == {
        "het_cached_row_wise": {"exact": pytest.approx(5e-6), "stale": pytest.approx(3e-6)},
        "het_row_replicated": {
            "exact": pytest.approx(2e-6),
            "stale": pytest.approx(-0.5e-6),
        },  # cheaper than table_wise
    }
    fallback = costs_from_micro(_micro(ids=None), "cmd")  # an older micro.json: batch x tables, one id each
    assert fallback["ids_per_step_per_rank"] == 400
    assert fallback["extra_seconds_per_id"]["het_cached_row_wise"]["exact"] == pytest.approx(5e-3 / 400)


def test_the_calibrate_command_writes_a_table_that_loads(tmp_path) -> None:
    micro = tmp_path / "micro.json"
    micro.write_text(json.dumps(_micro()))
    out = tmp_path / "costs.json"
    run = subprocess.run(
        [sys.executable, "-m", "torchrec_het_bench.calibrate", str(micro), "--command", "python -m torchrec_het_bench.micro",
         "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "het_row_replicated: exact +2000.0 ns/id, stale -500.0 ns/id" in run.stdout
    assert load_compute_costs(out).per_id("het_cached_row_wise", "stale") == pytest.approx(3e-6)
    assert json.loads(out.read_text())["revision"] == 1  # a first table
    again = subprocess.run(
        [sys.executable, "-m", "torchrec_het_bench.calibrate", str(micro), "--out", str(out), "--why", "new lookups"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr
    table = json.loads(out.read_text())
    assert (table["revision"], table["why"]) == (2, "new lookups")  # measured again: the next revision
    missing = subprocess.run(
        [sys.executable, "-m", "torchrec_het_bench.calibrate", str(tmp_path / "none.json"), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 2 and "none.json" in missing.stderr
