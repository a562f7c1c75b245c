"""An owner's reads of its own rows of ``het_cached_row_wise`` tables: weights and optimizer state
straight from the fused kernels' buffers (:class:`~torchrec_het.sharding.common.owned_rows.OwnedRows`),
else table by table."""

import torch

from torchrec_het import _tbe
from torchrec_het.sharding.common.owned_rows import OwnedRows
from torchrec_het.sharding.het_cache.groups import HetGroup


def read_rows(owned: OwnedRows, g: HetGroup, ids: torch.Tensor, part: str = _tbe.WEIGHTS) -> torch.Tensor:
    """Rows of owned fused ids of ``g`` from the local shards (``part=_tbe.STATE``: their optimizer state)."""
    tables = g.table_of(ids)
    rows, kernel_tables = g.local_rows(ids, tables), g.kernel_table.index_select(0, tables)
    if len(g.modules) == 1:
        out = owned.read(g.modules[0], g.dim, kernel_tables, rows, part)
        return _by_table(owned, g, ids, part) if out is None else out
    out = torch.empty(ids.numel(), g.dim if part == _tbe.WEIGHTS else g.state_width, device=owned.device)
    module_of = g.table_module.index_select(0, tables)
    for module_index in g.modules:
        mine = (module_of == module_index).nonzero().flatten()
        got = owned.read(module_index, g.dim, kernel_tables.index_select(0, mine), rows.index_select(0, mine), part)
        if got is None:
            return _by_table(owned, g, ids, part)
        out.index_copy_(0, mine, got)
    return out


def _by_table(owned: OwnedRows, g: HetGroup, ids: torch.Tensor, part: str) -> torch.Tensor:
    """:func:`read_rows` where a kernel's rows are not in one flat buffer (mixed placements, a cache)."""
    if part == _tbe.WEIGHTS:
        weights = [k.split_embedding_weights() for k in owned.kernels]
        return g.read_owned(ids, [weights[t.module_index][t.table_index] for t in g.tables])
    return g.read_owned(ids, [_tbe.row_state(owned.kernels[t.module_index], t.table_index)[1] for t in g.tables])


def fetched_rows(owned: OwnedRows, g: HetGroup, ids: torch.Tensor) -> torch.Tensor:
    """What an owner sends for each requested row: the row, then its optimizer state where the
    requester's cache keeps one (``g.fetch_width`` floats)."""
    rows = read_rows(owned, g, ids)
    if not g.state_width:
        return rows
    return torch.cat([rows, read_rows(owned, g, ids, _tbe.STATE)], 1)
