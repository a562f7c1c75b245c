"""What a sharded module with ``het_row_replicated`` tables offers beside TorchRec's API.

Shared by the bag (``HetShardedEmbeddingBagCollection``) and sequence
(``HetShardedEmbeddingCollection``) modules; both list their row-replicated lookups in
``replicated_lookups()``.
"""

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor


class ReplicatedModule:
    """Replica memory, replication counters and FAE's hot-sample test (a mixin)."""

    def replicated_lookups(self) -> list:
        raise NotImplementedError

    def reset_replication_stats(self) -> None:
        for lookup in self.replicated_lookups():
            lookup.replicas.stats = dict.fromkeys(lookup.replicas.stats, 0)

    def replica_nbytes(self) -> int:
        """Bytes of this rank's replica kernels (weights and optimizer state), beside its shards."""
        return sum(lookup.replicas.replica_nbytes() for lookup in self.replicated_lookups())

    def replication_stats(self) -> dict[str, int]:
        """Steps, all-hot steps that skipped the cold exchange, sparse and dense replica syncs, rows
        fetched (this rank); plain numbers (a counter kept as a tensor, to count without a host sync,
        is read here)."""
        totals: dict[str, int] = {}
        for lookup in self.replicated_lookups():
            for key, value in lookup.replicas.stats.items():
                totals[key] = totals.get(key, 0) + int(value)
        return totals

    def samples_read_here(self, features: KeyedJaggedTensor) -> torch.Tensor:
        """bool ``[batch]``: samples every row-replicated table of this module can look up on
        this rank (no exchange). Tables of other sharding types are not considered."""
        here = torch.ones(features.stride(), dtype=torch.bool, device=features.device())
        for lookup in self.replicated_lookups():
            here &= lookup.replicas.samples_read_here(features).to(here.device)
        return here
