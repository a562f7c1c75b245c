"""ReplicationConfig: settings are checked when made, and whole-model tiers are cut per module."""

from types import SimpleNamespace

import pytest
import torch

from torchrec_het.replication.config import ReplicationConfig


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


def test_restricted_to_keeps_only_the_named_tables() -> None:
    empty = torch.zeros(0, dtype=torch.int64)
    tiers = SimpleNamespace(tables={n: SimpleNamespace(num_rows=4, replicated=empty, per_host=empty) for n in "abc"})
    config = ReplicationConfig(tiers=tiers, replica_sync_every=3, skip_all_hot=False)
    cut = config.restricted_to({"a", "c"})
    assert sorted(cut.tiers.tables) == ["a", "c"] and sorted(config.tiers.tables) == ["a", "b", "c"]
    assert (cut.replica_sync_every, cut.skip_all_hot) == (3, False)
    assert ReplicationConfig().restricted_to({"a"}).tiers is None
