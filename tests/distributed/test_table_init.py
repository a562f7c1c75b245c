"""Every sharding of the same tables starts from the same weights (2 and 3 gloo ranks)."""

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig

from torchrec_het_bench.table_init import BLOCK_ROWS, table_rows
from torchrec_het_bench.testing.table_init_ranks import run_world
from torchrec_het_testing.spawn import spawn_world


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_outputs_match_unsharded_weights(world_size: int, tmp_path) -> None:
    for rank, errors in enumerate(spawn_world(run_world, world_size, tmp_path)):
        assert set(errors) == {"table_wise", "row_wise", "data_parallel"}
        assert max(errors.values()) < 1e-6, (rank, errors)


def test_rows_depend_only_on_seed_table_and_row() -> None:
    config = EmbeddingBagConfig(name="t", feature_names=["f"], embedding_dim=4, num_embeddings=3 * BLOCK_ROWS + 5)
    whole = table_rows(config, 1, 0, config.num_embeddings)
    assert torch.equal(
        table_rows(config, 1, BLOCK_ROWS - 3, 2 * BLOCK_ROWS + 9), whole[BLOCK_ROWS - 3 : 2 * BLOCK_ROWS + 9]
    )
    assert not torch.equal(table_rows(config, 2, 0, 10), whole[:10])
    other = EmbeddingBagConfig(name="u", feature_names=["f"], embedding_dim=4, num_embeddings=config.num_embeddings)
    assert not torch.equal(table_rows(other, 1, 0, 10), whole[:10])
    bound = config.num_embeddings**-0.5
    assert whole.abs().max() <= bound and whole.abs().max() > 0.9 * bound
    with pytest.raises(ValueError, match="table 't'"):
        table_rows(config, 1, 0, config.num_embeddings + 1)
