"""A stock EmbeddingBagCollection sharder that also offers row-wise sharding on CPU.

TorchRec's ``EmbeddingBagCollectionSharder.sharding_types("cpu")`` leaves out
``row_wise`` and ``table_row_wise`` although gloo implements every collective they
use (``all_to_all_single`` and ``reduce_scatter``). This sharder adds them back, so
the planner and ``DistributedModelParallel`` can place stock row-wise shards on CPU
ranks. Nothing else differs from the stock sharder.
"""

from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.types import ShardingType

_ROW_SPLIT_TYPES = (ShardingType.ROW_WISE.value, ShardingType.TABLE_ROW_WISE.value)


class CpuRowWiseEmbeddingBagCollectionSharder(EmbeddingBagCollectionSharder):
    """``EmbeddingBagCollectionSharder`` with row_wise and table_row_wise on CPU."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        types = list(super().sharding_types(compute_device_type))
        if compute_device_type == "cpu":
            types += [t for t in _ROW_SPLIT_TYPES if t not in types]
        return types
