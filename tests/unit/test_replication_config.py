"""ReplicationConfig: settings are checked when made, tiers against a module's tables; the tables of one
sharding must share their module-wide plan options."""

from types import SimpleNamespace

import pytest
import torch

from torchrec_het.plan_options import ReplicaOptions, shared_options
from torchrec_het.replication.config import ReplicationConfig, table_tiers


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"replica_sync_every": 0}, "replica_sync_every"),
        ({"local_world_size": 0}, "local_world_size"),
        ({"online_profile_steps": -1}, "online_profile_steps"),
        ({"online_max_hot_fraction": 1.5}, "online_max_hot_fraction"),
    ],
)
def test_bad_settings_raise_naming_the_setting(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReplicationConfig(**kwargs)
    with pytest.raises(ValueError, match=message):
        ReplicaOptions(**kwargs)  # a hand-written plan's options are checked the same way


def test_shared_tiers_are_checked_on_the_modules_own_tables_only() -> None:
    empty = torch.zeros(0, dtype=torch.int64)
    tiers = SimpleNamespace(tables={n: SimpleNamespace(num_rows=4, replicated=empty, per_host=empty) for n in "abc"})
    config = ReplicationConfig(tiers=tiers, replica_sync_every=3, skip_all_hot=False)
    config.check_tables({"a": 4, "c": 4}, shared=True)  # "b" is another module's
    with pytest.raises(ValueError, match=r"\['b'\]"):
        config.check_tables({"a": 4, "c": 4})
    with pytest.raises(ValueError, match="'c'"):
        config.check_tables({"a": 4, "c": 5}, shared=True)
    assert [t.numel() for t in table_tiers(tiers, "z", 9)] == [0, 0]  # a table it does not name: no hot rows
    ReplicationConfig().check_tables({"a": 4})


def test_tables_of_one_sharding_must_share_their_module_settings() -> None:
    a, b = ReplicaOptions(2, replicated_rows=3, per_host_rows=0), ReplicaOptions(2, replicated_rows=5, per_host_rows=1)
    assert shared_options({"a": a, "b": b}).replica_sync_every == 2  # tier sizes may differ
    for other in (ReplicaOptions(3), ReplicaOptions(2, skip_all_hot=False), ReplicaOptions(2, online_profile_steps=4)):
        with pytest.raises(ValueError, match=r"tables \['a', 'b'\] of one module must share"):
            shared_options({"a": a, "b": other})
    with pytest.raises(ValueError, match="not a multiple of 3"):
        ReplicaOptions(local_world_size=3).ranks_per_host(4)
