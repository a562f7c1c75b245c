"""CommAccountant on real gloo groups of 2 and 3 ranks.

Every check of one world size runs inside one spawned group
(:mod:`torchrec_het_bench.testing.comm_ranks`); the ranks report what they counted
and the facts behind it, and the expected bytes are computed here by hand.
"""

from dataclasses import dataclass

import pytest

from torchrec_het_bench.testing.comm_ranks import BATCH_SIZE, DDP_STEPS, DDP_VARIANTS, DENSE_OUT, TABLES, run_world
from torchrec_het_testing.spawn import spawn_world

FLOAT32 = 4
INT64 = 8


@dataclass
class World:
    size: int
    ranks: list[dict]  # what each rank observed, by check name

    def check(self, name: str) -> list[dict]:
        return [observed[name] for observed in self.ranks]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda ws: f"ws{ws}")
def world(request, tmp_path_factory) -> World:
    size = request.param
    out = tmp_path_factory.mktemp(f"comm_ws{size}")
    return World(size, spawn_world(run_world, size, out))


def _only_entry(entries: list[dict]) -> dict:
    assert len(entries) == 1, entries
    return entries[0]


# --- the wrapped collectives -------------------------------------------------------------


def _all_reduce_of_10_floats(ws: int, rank: int) -> list[int]:
    # 10 elements cut into ws chunks; peer j gets chunk j (reduce-scatter) + own chunk (all-gather).
    if ws == 2:
        return [40, 40]  # chunks 20 + 20 bytes
    return [[32, 28, 28], [28, 24, 24], [28, 24, 24]][rank]  # chunks 16, 12, 12 bytes


def _expected_collective(name: str, ws: int, rank: int) -> tuple[str, str, list[int]]:
    """(family, phase, bytes to each rank) of the cases in comm_ranks.COLLECTIVE_CASES."""
    peers = range(ws)
    reduce_scatter_tensor = ("reduce_scatter", "fwd_emb", [2 * 5 * FLOAT32] * ws)
    all_gather_int32 = ("all_gather", "fwd_ids", [4 * 4] * ws)
    return {
        "all_to_all_single": ("all_to_all", "fwd_emb", [(rank + j + 1) * 3 * FLOAT32 for j in peers]),
        "all_to_all_single_equal": ("all_to_all", "fwd_ids", [2 * INT64] * ws),
        "all_to_all": ("all_to_all", "fwd_emb", [2 * 8] * ws),
        "reduce_scatter": ("reduce_scatter", "fwd_emb", [(j + 1) * FLOAT32 for j in peers]),
        "reduce_scatter_tensor": reduce_scatter_tensor,
        "reduce_scatter_single": reduce_scatter_tensor,
        "_reduce_scatter_base": reduce_scatter_tensor,
        "all_gather": ("all_gather", "fwd_emb", [3 * FLOAT32] * ws),
        "all_gather_into_tensor": all_gather_int32,
        "all_gather_single": all_gather_int32,
        "_all_gather_base": all_gather_int32,
        "all_reduce": ("all_reduce", "fwd_emb", _all_reduce_of_10_floats(ws, rank)),
        "broadcast": ("broadcast", "fwd_emb", [6 * 8 if rank == 1 else 0] * ws),
    }[name]


def test_each_collective_counts_hand_computed_bytes(world: World) -> None:
    for rank, observed in enumerate(world.check("collectives")):
        assert len(observed) == 2 * 13
        for key, seen in observed.items():
            name, mode = key.split("/")
            family, phase, sends = _expected_collective(name, world.size, rank)
            assert _only_entry(seen["entries"]) == {"phase": phase, "family": family, "sends": sends, "calls": 1}, key


def test_wrappers_return_what_torch_returns(world: World) -> None:
    for observed in world.check("collectives"):
        for key, seen in observed.items():
            assert seen["result_right"], key
            assert seen["returned"] == ("work" if key.endswith("/async") else "None"), key


def test_group_ranks_map_to_global_ranks(world: World) -> None:
    ws = world.size
    outsider, *members = world.check("groups")
    assert outsider == {"outsider": []}  # not in the group: torch does nothing, nothing counted
    for rank, seen in enumerate(members, start=1):
        me = rank - 1
        assert _only_entry(seen["all_gather"])["sends"] == [0] + [2 * FLOAT32] * (ws - 1)
        a2a = _only_entry(seen["all_to_all_single"])
        assert (a2a["phase"], a2a["sends"]) == ("fwd_ids", [0] + [(me + j + 1) * INT64 for j in range(ws - 1)])
        source_sends = [0] + [3 * FLOAT32] * (ws - 1) if rank == ws - 1 else [0] * ws
        for name in ("broadcast_group_src", "broadcast_src"):
            assert _only_entry(seen[name])["sends"] == source_sends, name


def test_install_restores_originals_and_passes_errors_through(world: World) -> None:
    for seen in world.check("install"):
        assert seen["replaced"] and seen["wraps_original"] and seen["names_kept"]
        assert seen["still_installed_after_nested_exit"]
        assert "already installed" in seen["second_accountant_error"]
        assert seen["wrapped_errors"] == seen["plain_errors"]
        assert all(error.startswith(("TypeError", "ValueError")) for error in seen["plain_errors"].values())
        assert seen["counted_after_errors"] == 0 and seen["counted_while_paused"] == 0
        assert seen["restored_after_exit"] and seen["restored_after_error"]
        assert seen["raised_inside"] == "KeyError: 'inside'"


def test_phase_rules(world: World) -> None:
    for seen in world.check("phases"):
        assert seen["float"] == ["fwd_emb"]
        assert seen["int"] == seen["int32"] == ["fwd_ids"]
        assert seen["override_float"] == seen["override_int"] == ["other"]
        assert seen["nested_override"] == ["fwd_ids"]  # innermost override wins
        assert seen["backward"] == ["bwd_grad"]
        assert seen["backward_override"] == ["other"]
        assert seen["input_dist_float"] == ["fwd_ids"]
        assert seen["unknown_phase_error"].startswith("ValueError")


def test_sum_over_ranks_adds_every_rank_and_counts_nothing(world: World) -> None:
    ws = world.size
    seen = world.check("phases")
    # Rank k sends k + j + 1 floats to rank j with all_to_all_single.
    expected_matrix = [[(k + j + 1) * FLOAT32 for j in range(ws)] for k in range(ws)]
    for rank, observed in enumerate(seen):
        assert observed["counted_by_sum_over_ranks"] == 0
        assert observed["summed_matrix"] == expected_matrix
        own_cross = sum(n for j, n in enumerate(expected_matrix[rank]) if j != rank)
        assert observed["own_summary"]["phases"]["fwd_emb"] == own_cross
        summed = observed["summed_summary"]
        assert summed["phases"]["fwd_emb"] == sum(o["own_summary"]["phases"]["fwd_emb"] for o in seen)
        assert summed["payload"]["fwd_emb"] == sum(map(sum, expected_matrix))
        assert summed["calls"]["fwd_emb"] == ws


# --- DDP ---------------------------------------------------------------------------------


def test_ddp_hook_counts_buckets_and_trains_identically(world: World) -> None:
    ws = world.size
    bucket_bytes = 24 * FLOAT32  # Linear(4, 4) + Linear(4, 1, bias=False): one bucket
    for seen in world.check("ddp"):
        assert len(seen) == 4 + len(DDP_VARIANTS)
        for bucket_view, set_to_none in DDP_VARIANTS:
            variant = f"bucket_view={bucket_view},set_to_none={set_to_none}"
            run = seen[variant]
            assert run["identical"], variant
            assert run["unhooked_calls"] == 0  # DDP's C++ all-reduce is invisible without the hook
            assert _only_entry(run["hooked"]) == {
                "phase": "dense_allreduce",
                "family": "all_reduce",
                "sends": [DDP_STEPS * 2 * bucket_bytes // ws] * ws,
                "calls": DDP_STEPS,
            }
        assert (seen["first_attach"], seen["second_attach"]) == (1, 0)
        assert "already has the comm hook '_noop_hook'" in seen["foreign_hook_error"]
        assert "before the first forward" in seen["after_forward_error"]


# --- a real TorchRec step ----------------------------------------------------------------

DIMS = {feature: dim for _, feature, dim, _ in TABLES}
DENSE_BYTES = sum(DIMS.values()) * DENSE_OUT * FLOAT32  # 192: divides evenly by 2 and 3 ranks


def _owner_of_id(table: dict, row: int) -> int:
    return next(s["rank"] for s in table["shards"] if s["row_offset"] <= row < s["row_offset"] + s["rows"])


def _table_wise_rows(seen: dict, rank: int, ws: int) -> dict[str, list[int]]:
    """Bytes rank sends to each rank in one table-wise step (weighted features)."""
    owner = {t["feature"]: t["shards"][0]["rank"] for t in seen["tables"]}
    features_of = [[f for f in DIMS if owner[f] == j] for j in range(ws)]
    dims_of = [sum(DIMS[f] for f in features) for features in features_of]
    per_id = seen["values_itemsize"] + seen["weights_itemsize"]
    splits = 4 * INT64  # per-rank counts of lengths, values, weights, plus the batch size
    return {
        "fwd_ids": [
            splits
            + BATCH_SIZE * len(features_of[j]) * seen["lengths_itemsize"]
            + sum(len(seen["ids"][f]) for f in features_of[j]) * per_id
            for j in range(ws)
        ],
        "fwd_emb": [BATCH_SIZE * dims_of[rank] * FLOAT32] * ws,  # my tables, pooled for every rank's batch
        "bwd_grad": [BATCH_SIZE * dims_of[j] * FLOAT32 for j in range(ws)],  # gradients of my batch to owners
        "dense_allreduce": [2 * DENSE_BYTES // ws] * ws,
    }


def _row_wise_rows(seen: dict, rank: int, ws: int) -> dict[str, list[int]]:
    """Bytes rank sends to each rank in one row-wise step (unweighted features)."""
    ids_to = [0] * ws
    for table in seen["tables"]:
        for row in seen["ids"][table["feature"]]:
            ids_to[_owner_of_id(table, row)] += 1
    pooled = BATCH_SIZE * sum(DIMS.values()) * FLOAT32
    return {
        "fwd_ids": [
            3 * INT64 + BATCH_SIZE * len(DIMS) * seen["lengths_itemsize"] + ids_to[j] * seen["values_itemsize"]
            for j in range(ws)
        ],
        "fwd_emb": [pooled] * ws,  # partial pools of every rank's batch, reduce-scattered
        "bwd_grad": [pooled] * ws,  # my batch's gradients, all-gathered
        "dense_allreduce": [2 * DENSE_BYTES // ws] * ws,
    }


def _assert_summary_consistent(seen: dict) -> None:
    summary = seen["summary"]
    phases = summary["phases"]
    embedding = ("fwd_ids", "fwd_emb", "bwd_grad", "other")
    assert phases["embedding_cross_rank"] == sum(phases[p] for p in embedding)
    assert phases["embedding_total"] == sum(summary["payload"][p] for p in embedding)
    assert sum(summary["by_collective"].values()) == phases["embedding_cross_rank"]


def test_table_wise_step_bytes(world: World) -> None:
    for rank, seen in enumerate(world.check("torchrec_table_wise")):
        assert {t["sharding_type"] for t in seen["tables"]} == {"table_wise"}
        assert seen["ddp_hooked"] == 1 and seen["weights_itemsize"] == FLOAT32
        assert seen["dense_params"] * FLOAT32 == DENSE_BYTES
        assert seen["phase_rows"] == _table_wise_rows(seen, rank, world.size)
        _assert_summary_consistent(seen)
        by_collective = seen["summary"]["by_collective"]
        assert by_collective["all_to_all"] == seen["summary"]["phases"]["embedding_cross_rank"]
        assert by_collective["reduce_scatter"] == by_collective["all_gather"] == 0


def test_row_wise_step_bytes(world: World) -> None:
    ws = world.size
    for rank, seen in enumerate(world.check("torchrec_row_wise")):
        assert {t["sharding_type"] for t in seen["tables"]} == {"row_wise"}
        assert all(len(t["shards"]) == ws for t in seen["tables"])
        assert seen["phase_rows"] == _row_wise_rows(seen, rank, ws)
        _assert_summary_consistent(seen)
        phases, by_collective = seen["summary"]["phases"], seen["summary"]["by_collective"]
        assert by_collective["reduce_scatter"] == phases["fwd_emb"] > 0
        assert by_collective["all_gather"] == phases["bwd_grad"] > 0
        assert by_collective["all_to_all"] == phases["fwd_ids"]
