"""An owner's reads of its own rows of ``het_cached_row_wise`` tables: weights and optimizer state
straight from the fused kernels' buffers, through their ``[rows, width]`` views where the buffers
allow them (:mod:`torchrec_het.sharding.common.owned_rows`), else table by table."""

import torch
from torch import nn

from torchrec_het import _tbe
from torchrec_het.sharding.common.owned_rows import OwnedRows
from torchrec_het.sharding.het_cache.groups import HetGroup


class HetOwnedRows(OwnedRows):
    """Reads the rows this rank owns from the lookup's fused kernels (local compute), through the
    kernels' row views (:class:`~torchrec_het.sharding.common.owned_rows.OwnedRows`).

    Args:
        kernels: the lookup's TorchRec kernels, one per grouped config (``_compat.lookup_kernels``).
        device: where the rows read are returned.
    """

    def __init__(self, kernels: nn.ModuleList, device: torch.device) -> None:
        super().__init__([k.emb_module for k in kernels], device)
        self.modules = kernels

    def _rows_view(self, module_index: int, g: HetGroup, prefix: str):
        """(``[rows, width]`` view of ``prefix``, first row of each kernel table) or None."""
        view = self.view(module_index, g.dim)
        if view is None:
            return None
        if prefix == _tbe.WEIGHTS:
            return view.weights, view.first_row
        return None if view.state is None else (view.state, view.state_first_row)

    def read(self, g: HetGroup, ids: torch.Tensor, prefix: str = _tbe.WEIGHTS) -> torch.Tensor:
        """Rows of owned fused ids from the local shards (``prefix=_tbe.STATE``: their optimizer state)."""
        width = g.dim if prefix == _tbe.WEIGHTS else g.state_width
        tables = g.table_of(ids)
        rows = g.local_rows(ids, tables)
        out = None
        for module_index in g.modules:
            view = self._rows_view(module_index, g, prefix)
            if view is None:
                return self.read_by_table(g, ids, prefix)
            shard, first_row = view
            at = first_row.index_select(0, g.kernel_table.index_select(0, tables)) + rows
            if len(g.modules) == 1:
                return shard.index_select(0, at).float()
            out = torch.empty(ids.numel(), width, device=self.device) if out is None else out
            mine = (g.table_module.index_select(0, tables) == module_index).nonzero().flatten()
            out.index_copy_(0, mine, shard.index_select(0, at.index_select(0, mine)).float())
        return out if out is not None else torch.empty(0, width, device=self.device)

    def read_by_table(self, g: HetGroup, ids: torch.Tensor, prefix: str) -> torch.Tensor:
        """:meth:`read` for kernels whose buffers are not one flat tensor (mixed placements)."""
        if prefix == _tbe.WEIGHTS:
            weights = [m.split_embedding_weights() for m in self.modules]
            return g.read_owned(ids, [weights[t.module_index][t.table_index] for t in g.tables])
        return g.read_owned(ids, [_tbe.row_state(self.kernels[t.module_index], t.table_index)[1] for t in g.tables])

    def fetched(self, g: HetGroup, ids: torch.Tensor) -> torch.Tensor:
        """What an owner sends for each requested row: the row, then its optimizer state where the
        requester's cache keeps one (``g.fetch_width`` floats)."""
        rows = self.read(g, ids)
        if not g.state_width:
            return rows
        return torch.cat([rows, self.read(g, ids, _tbe.STATE)], 1)
