"""het_row_replicated on 2 hosts x 2 ranks (per-host tier, hierarchical replica sync), and checkpoints across world sizes."""

from pathlib import Path

import pytest

from torchrec_het_testing.replicated_more_ranks import run_load, run_save, run_two_hosts, run_two_hosts_hierarchical
from torchrec_het_testing.spawn import spawn_world

TOLERANCE = 1e-5


def test_two_hosts_train_exactly_and_keep_cold_bytes_inside_hosts(tmp_path) -> None:
    world = spawn_world(run_two_hosts, 4, tmp_path)
    for rank, errors in enumerate(world):
        assert errors["weights_rep_vs_unsharded/sum"] < TOLERANCE, (rank, errors)
        assert errors["weights_rep_vs_unsharded/mean"] < TOLERANCE, (rank, errors)
        assert errors["replica_disagreement"] == 0.0, (rank, errors)
    assert sum(e["per_host_held"] for e in world) > 0  # the per-host tier holds rows away from their owners
    rep, stock = world[0]["bytes"]["rep"], world[0]["bytes"]["row_wise"]
    assert 0 < rep["inter_host"] < stock["inter_host"], world[0]["bytes"]
    assert rep["cross_rank"] > rep["inter_host"], world[0]["bytes"]  # some traffic stays inside a host


@pytest.mark.parametrize("saved_world,loaded_world", [(2, 3), (3, 2)])
def test_checkpoint_holds_each_table_once_and_loads_into_another_world_size(tmp_path, saved_world, loaded_world):
    spawn_world(run_save, saved_world, tmp_path)
    Path(tmp_path, "saved_world").write_text(str(saved_world))
    world = spawn_world(run_load, loaded_world, tmp_path)
    for rank, errors in enumerate(world):
        assert errors["loaded_vs_unsharded/sum"] < TOLERANCE, (rank, errors)
        assert errors["out_rep_vs_unsharded"] < TOLERANCE, (rank, errors)
        assert errors["weights_rep_vs_unsharded/sum"] < TOLERANCE, (rank, errors)
        assert errors["weights_rep_vs_unsharded/mean"] < TOLERANCE, (rank, errors)
        assert errors["replica_disagreement"] == 0.0, (rank, errors)
        # one entry per table, of the table's full size: replicas are not exported
        assert errors["state_rows"] == {
            "embedding_bags.t0.weight": [50, 8],
            "embedding_bags.t1.weight": [37, 4],
            "embedding_bags.t2.weight": [101, 8],
        }, errors["state_rows"]


def test_two_hosts_sync_replicas_hierarchically_exactly(tmp_path) -> None:
    """Replicated rows' gradients: within a host, between host leaders, back within the host.
    Exact against the unsharded model, fewer bytes between hosts than the flat sync; and the
    tiers ProfileTiers chooses on the topology (per-host rows included) train exactly too."""
    world = spawn_world(run_two_hosts_hierarchical, 4, tmp_path)
    for rank, errors in enumerate(world):
        for name in ("hier", "flat", "profiled"):
            assert errors[f"weights_{name}_vs_unsharded/sum"] < TOLERANCE, (rank, name, errors)
            assert errors[f"weights_{name}_vs_unsharded/mean"] < TOLERANCE, (rank, name, errors)
            assert errors[f"replica_disagreement_{name}"] == 0.0, (rank, name, errors)
        assert errors["hierarchical_hier"] and not errors["hierarchical_flat"], errors
        assert errors["syncs_hier"] > 0 and errors["syncs_profiled"] > 0, errors
        assert errors["hierarchical_profiled"], errors
    tiers = world[0]["profiled_tiers"]  # the topology's rule: replicated rows, then per-host ones
    assert all(replicated > 0 for replicated, _ in tiers.values()) and sum(host for _, host in tiers.values()) > 0, tiers
    got = world[0]["bytes"]
    hier, flat, stock = got["hier"]["inter_host"], got["flat"]["inter_host"], got["row_wise"]["inter_host"]
    assert 0 < hier < flat < stock, got
    assert got["hier"]["cross_rank"] > hier, got  # the within-host sums stay inside hosts
    assert got["profiled"]["inter_host"] < stock, got
