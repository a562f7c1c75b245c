"""The sharded-module microbenchmark: one command, 2 gloo ranks, every type, a JSON file."""

import json
import math
import subprocess
import sys

import pytest

from torchrec_het_bench.comm import COLLECTIVE_FAMILIES
from torchrec_het_bench.micro import MICRO_TYPES
from torchrec_het_bench.presets import get_preset


@pytest.fixture(scope="module")
def micro(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("micro")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torchrec_het_bench.micro",
            "--preset",
            "smoke",
            "--warmup-steps",
            "1",
            "--steps-per-round",
            "1",
            "--rounds",
            "3",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    assert "| table_wise | stock_table_wise |" in run.stdout
    assert (out / "micro.md").read_text() in run.stdout
    return json.loads((out / "micro.json").read_text())


def test_every_type_is_measured_on_the_presets_tables(micro: dict) -> None:
    preset = get_preset("smoke")
    assert micro["world_size"] == 2 and micro["tables"] == 26 == len(preset.table_sizes)
    assert micro["batch_size_per_rank"] == preset.batch_size and micro["alpha"] == preset.alpha
    assert micro["embedding_optimizer"] == "rowwise_adagrad"
    assert micro["ids_per_step_per_rank"] == preset.batch_size * 26  # one id per feature per sample
    assert [t["name"] for t in micro["types"]] == list(MICRO_TYPES)
    for t in micro["types"]:
        assert t["measured_steps"] == 3
        ms = t["ms_per_step"]
        assert all(math.isfinite(v) for v in ms.values()) and 0 < ms["p10"] <= ms["median"] <= ms["p90"], t
        calls = t["collectives_per_step"]
        assert set(calls["by_family"]) == set(COLLECTIVE_FAMILIES)
        assert calls["total"] == pytest.approx(sum(calls["by_family"].values()))
        assert calls["total"] == pytest.approx(sum(calls["by_phase"].values()))
        assert calls["by_family"]["all_to_all"] >= 1, t  # every type sends ids somewhere
        assert t["embedding_cross_rank_bytes_per_step"] > 0


def test_the_types_are_the_ones_asked_for(micro: dict) -> None:
    by_name = {t["name"]: t for t in micro["types"]}
    assert by_name["table_wise"]["sharding_types"] == ["table_wise"]
    assert by_name["row_wise"]["sharding_types"] == ["row_wise"]
    for name in ("het_cached_s0", "het_cached_s10"):
        assert by_name[name]["sharding_types"] == ["het_cached_row_wise"]
        assert by_name[name]["hot_fraction"] is None
    assert by_name["het_cached_s0"]["params"]["s_read"] == 0 and by_name["het_cached_s10"]["params"]["s_read"] == 10
    for name, sync in (("het_replicated_s1", 1), ("het_replicated_s10", 10)):
        assert by_name[name]["sharding_types"] == ["het_row_replicated"]
        assert by_name[name]["params"]["replica_sync_every"] == sync
        assert 0 < by_name[name]["hot_fraction"] < 0.5
    # Stock table-wise returns pooled rows with all-to-alls only; row-wise reduce-scatters partial pools.
    tw, rw = by_name["table_wise"]["collectives_per_step"], by_name["row_wise"]["collectives_per_step"]
    assert tw["total"] == tw["by_family"]["all_to_all"] and tw["total"] == int(tw["total"])
    assert rw["by_family"]["reduce_scatter"] >= 1


def test_a_batch_way_is_counted_in_runtime_files(micro: dict) -> None:
    by_name = {t["name"]: t for t in micro["types"]}
    assert by_name["row_wise"]["batch_files"] == []  # stock TorchRec runs none of the plugin's files
    for name, own in (
        ("het_cached_s0", "row_replicated/cached_tier.py"),  # an exact cache: the fetched-rows tier
        ("het_replicated_s1", "row_replicated/dists.py"),
    ):
        files = by_name[name]["batch_files"]
        assert any(f.endswith(own) for f in files), files
        assert all(f.split("/")[0] in ("torchrec_het", "sharders") for f in files), files
