"""Settings through the plan: for every table, what the planner priced is what the lookup runs with.

Two gloo ranks plan collectively (rank 0 plans, the plan is broadcast), shard with
DistributedModelParallel and train one step (rank body: ``torchrec_het_testing.plan_options_ranks``).
"""

import dataclasses

from torchrec_het_testing import plan_options_ranks as ranks
from torchrec_het_testing.spawn import spawn_world


def test_every_table_runs_with_the_options_the_planner_priced(tmp_path) -> None:
    results = spawn_world(ranks.run_world, ranks.WORLD_SIZE, tmp_path)
    priced = results[0]["priced"]  # only rank 0 plans
    assert set(priced) == set(ranks.TABLES)
    assert priced["cached_a"] == dataclasses.asdict(ranks.CACHED_A)  # the sharder's per-table setting
    assert priced["cached_b"]["capacity"] == 0.25
    for rank, seen in enumerate(results):
        assert seen["loss"] > 0, rank
        for name, sharding_type in ranks.TYPES.items():
            entry = seen["planned"][name]
            assert entry["type"] == sharding_type and entry["class"] == "HetParameterSharding", (rank, name)
            assert entry["options"] == priced[name], (rank, name)  # the broadcast plan carries what was priced
            runs = seen["runs"][name]
            if sharding_type == "het_cached_row_wise":
                assert runs == priced[name], (rank, name)
            else:
                expected = {k: priced[name][k] for k in ("replica_sync_every", "skip_all_hot", "replicated_rows")}
                expected["codecs"] = ranks.QCOMMS  # the sharder's codecs reached the sharding
                assert runs == expected, (rank, name)
                assert runs["replicated_rows"] > 0 and priced[name]["profile"], (rank, name)
            assert name in seen["printed"].split("torchrec_het options")[1], rank  # print(plan) shows it
