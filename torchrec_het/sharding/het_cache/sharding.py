"""``het_cached_row_wise``: row-wise owners, a stale-tolerant cache of remote rows on every rank.

In TorchRec's grammar: the input dist sends requests, the lookup
(:class:`HetCachedEmbeddingLookup`) is local compute, the output dist brings rows back,
settles the cache and pools (:mod:`~torchrec_het.sharding.het_cache.dists`). Shards, grouping,
state dict and fused optimizer are row-wise's own; each table's ``CacheSettings`` come from
its plan entry (:class:`~torchrec_het.plan_options.HetParameterSharding` ``options``). The
sharder's quantized comms (``qcomm_codecs_registry``, the pooled all-to-all's codecs) code the
rows fetched and the gradients pushed (:mod:`~torchrec_het.sharding.het_cache.coded_rows`).
"""

from torchrec.distributed.sharding.rw_sharding import RwPooledEmbeddingSharding

from torchrec_het.config import CacheSettings
from torchrec_het.sharding.common.row_wise import StagedSharding, row_wise_as
from torchrec_het.sharding.common.wire_codec import BAGS, codecs_of
from torchrec_het.sharding.het_cache.dists import HetRequestsDist, HetRowsDist
from torchrec_het.sharding.het_cache.lookup import HetCachedEmbeddingLookup
from torchrec_het.types import HET_CACHED_ROW_WISE


class HetCachedRwPooledEmbeddingSharding(StagedSharding, RwPooledEmbeddingSharding):
    """Row-wise shards, read and written through the HET cache, in TorchRec's three stages.

    Args:
        sharding_infos: TorchRec's per-table sharding infos (without the plugin's key).
        env: sharding environment.
        hot_rows: unused (None): ``het_row_replicated``'s argument.
        device: compute device.
    """

    lookup_class = HetCachedEmbeddingLookup
    sharding_type = HET_CACHED_ROW_WISE

    def lookup_config(self, options_by_table: dict, hot_rows) -> dict:
        """The lookup runs with each table's ``CacheSettings`` from the plan."""
        return dict(options_by_table)

    def lookup_settings(self) -> dict:
        """Row-wise's settings, and the codecs of the rows fetched and the gradients pushed."""
        return {**super().lookup_settings(), "codecs": codecs_of(self.qcomm_codecs_registry, BAGS)}

    def create_input_dist(self, device=None) -> HetRequestsDist:
        return HetRequestsDist(self.create_lookup())

    def create_output_dist(self, device=None) -> HetRowsDist:
        return HetRowsDist(self.create_lookup())


def het_cached_row_wise(options: CacheSettings | None = None):
    """A ``per_param_sharding`` generator for TorchRec's ``construct_module_sharding_plan``.

    Shards a table row-wise over all ranks (TorchRec's own row-wise sizes and offsets)
    and marks it ``het_cached_row_wise``, with ``options`` as its cache settings (None: the
    sharder's, filled in when it shards). The sharder must offer row_wise and the
    het type (:class:`torchrec_het.sharders.HetEmbeddingBagCollectionSharder` does).
    """
    return row_wise_as(HET_CACHED_ROW_WISE, options=options)
