"""Fixtures shared by the unit tests."""

import pytest
import torch.distributed as dist
from torchrec.distributed.types import ShardingEnv


@pytest.fixture(scope="module")
def one_rank_env():
    """A world-size-1 gloo group in this process (sharding needs one), destroyed after the module's tests."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield ShardingEnv.from_process_group(dist.group.WORLD)
    finally:
        dist.destroy_process_group()
