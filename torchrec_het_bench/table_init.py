"""The same embedding weights for every sharding: row ``r`` of a table depends only on (seed, table, r).

DistributedModelParallel initializes each shard on its own, so table_wise and
row_wise runs start from different weights and their AUCs differ by the
initialization alone. :func:`init_tables_by_row` overwrites every local shard
with values drawn block by block from generators seeded by (seed, table, block),
so any plan of the same tables starts from identical weights, at a cost
proportional to the shard, not the table. Values follow TorchRec's default
initialization: uniform in ``[-1/sqrt(rows), 1/sqrt(rows)]``.
"""

import hashlib
import math

import torch
from torch import nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig

from torchrec_het import _compat

BLOCK_ROWS = 4096


def _block_seed(seed: int, table: str, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{table}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def table_rows(config: BaseEmbeddingConfig, seed: int, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` (all columns) of table ``config`` as :func:`init_tables_by_row` sets them."""
    if not 0 <= start <= stop <= config.num_embeddings:
        raise ValueError(f"table {config.name!r}: rows {start}:{stop} outside 0:{config.num_embeddings}")
    bound = 1.0 / math.sqrt(config.num_embeddings)
    parts = []
    for block in range(start // BLOCK_ROWS, (stop + BLOCK_ROWS - 1) // BLOCK_ROWS):
        first = block * BLOCK_ROWS
        rows = min(BLOCK_ROWS, config.num_embeddings - first)
        generator = torch.Generator().manual_seed(_block_seed(seed, config.name, block))
        values = torch.empty(rows, config.embedding_dim).uniform_(-bound, bound, generator=generator)
        parts.append(values[max(start, first) - first : min(stop, first + rows) - first])
    if not parts:
        return torch.empty(0, config.embedding_dim)
    return torch.cat(parts)


def _fill(weight: torch.Tensor, config: BaseEmbeddingConfig, seed: int, row0: int, col0: int) -> None:
    rows, cols = weight.shape
    for start in range(0, rows, BLOCK_ROWS):  # block by block: no shard-sized temporary
        stop = min(rows, start + BLOCK_ROWS)
        values = table_rows(config, seed, row0 + start, row0 + stop)[:, col0 : col0 + cols]
        weight[start:stop].copy_(values.to(weight.dtype))


@torch.no_grad()
def init_tables_by_row(model: nn.Module, tables: list[BaseEmbeddingConfig], seed: int) -> int:
    """Overwrites every local shard of ``tables``' weights in ``model``'s state dict.

    Args:
        model: a sharded (or unsharded) model whose state dict holds the tables'
            weights under keys ending in ``.<table name>.weight``.
        tables: the tables to set.
        seed: the run's seed.

    Returns:
        How many state-dict entries were set.

    Raises:
        KeyError: a table's weight is not in the state dict.
    """
    by_key = {f".{t.name}.weight": t for t in tables}
    done = set()
    count = 0
    for key, value in model.state_dict().items():
        suffix = next((s for s in by_key if key.endswith(s)), None)
        if suffix is None:
            continue
        config = by_key[suffix]
        if _compat.is_sharded_tensor(value):
            for shard in value.local_shards():
                row0, col0 = shard.metadata.shard_offsets
                _fill(shard.tensor, config, seed, row0, col0)
        else:
            _fill(value, config, seed, 0, 0)
        done.add(config.name)
        count += 1
    missing = sorted(t.name for t in tables if t.name not in done)
    if missing:
        raise KeyError(f"no weights for table(s) {missing} in the model's state dict")
    return count
