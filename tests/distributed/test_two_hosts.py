"""Four gloo ranks as 2 hosts x 2 (rank bodies: :mod:`torchrec_het_bench.testing.two_hosts_ranks`,
one process group): ``het_row_replicated``'s per-host tier and hierarchical replica sync train
as the unsharded model (the generic body of tests/distributed/test_sharded_vs_unsharded.py,
under every pipeline), and the bytes the benchmark's byte accounting counts while they train
show what they save: traffic kept inside hosts, and TorchRec's quantized comms on the plugin's sharders."""

import pytest

from torchrec_het_bench.testing.two_hosts_ranks import CASES, run_world
from torchrec_het_testing.expectations import case_problems
from torchrec_het_testing.spawn import spawn_world


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> list[dict]:
    return spawn_world(run_world, 4, tmp_path_factory.mktemp("two_hosts"))


@pytest.fixture(scope="module")
def totals(world) -> dict[str, dict]:
    """Each case's bytes (summed over ranks: every rank has the same)."""
    for name in CASES:
        if "error" in world[0][name]:
            pytest.fail(f"case {name} raised:\n{world[0][name]['error']}")
    assert all(r[name]["bytes"] == world[0][name]["bytes"] for r in world for name in CASES), "totals differ by rank"
    return {name: world[0][name]["bytes"] for name in CASES}


# Stock row_wise is the bytes baseline only: on these tables (a mean-pooled table beside a feature
# that feeds two tables) TorchRec's own row_wise drifts from the unsharded model.
@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.sharding_type != "row_wise"])
def test_sharded_trains_like_the_unsharded_model(world, name: str) -> None:
    problems = case_problems(CASES[name], [r[name] for r in world])
    assert not problems, "\n".join(problems)


def test_the_per_host_tier_keeps_cold_bytes_inside_hosts(totals) -> None:
    per_host, stock = totals["per_host"], totals["row_wise"]
    assert 0 < per_host["inter_host"] < stock["inter_host"], totals
    assert per_host["cross_rank"] > per_host["inter_host"], totals  # some traffic stays inside a host


def test_replica_gradients_summed_within_hosts_first_cross_between_hosts_less(totals) -> None:
    hierarchical, flat, stock = (totals[k]["inter_host"] for k in ("hierarchical", "flat", "row_wise"))
    assert 0 < hierarchical < flat < stock, totals
    assert totals["hierarchical"]["cross_rank"] > hierarchical, totals  # the within-host sums stay inside hosts


def test_tiers_from_a_profile_on_the_topology_cross_between_hosts_less_than_stock(world, totals) -> None:
    tiers = world[0]["profiled_tiers"]  # the topology's rule: replicated rows, then per-host ones
    assert all(replicated > 0 for replicated, _ in tiers.values()) and sum(host for _, host in tiers.values()) > 0, (
        tiers
    )
    assert totals["profiled"]["inter_host"] < totals["row_wise"]["inter_host"], totals


def test_codecs_on_the_plugin_sharders_cut_its_bytes(totals) -> None:
    """fp16 partial sums forward, bf16 gradients backward: the float payloads halve, ids do not."""
    fp32, codecs = totals["wire_fp32"]["all_to_all"], totals["wire_fp16_bf16"]["all_to_all"]
    assert 0 < codecs < 0.8 * fp32, totals
