"""An owner's reads of its own rows of ``het_cached_row_wise`` tables: weights and optimizer state
straight from the fused kernels' buffers (:mod:`torchrec_het._tbe`), as one ``[rows, width]`` view
per kernel where the buffer allows it."""

import torch
from torch import nn

from torchrec_het import _tbe
from torchrec_het.sharding.het_cache.groups import HetGroup


class OwnedRows:
    """Reads the rows this rank owns from the lookup's fused kernels (local compute).

    Args:
        kernels: the lookup's TorchRec kernels, one per grouped config (``_compat.lookup_kernels``).
        device: where the rows read are returned.
    """

    def __init__(self, kernels: nn.ModuleList, device: torch.device) -> None:
        self.kernels = kernels
        self.device = device
        self.views: dict[tuple, tuple] = {}  # (kernel, group, prefix) -> (buffer attribute, its data_ptr, view)

    def forget(self) -> None:
        """Drops the views (after a load the kernels may hold new buffers)."""
        self.views = {}

    def view(
        self, module_index: int, g: HetGroup, prefix: str = _tbe.WEIGHTS
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(``[rows, width]`` view of a kernel's flat ``prefix`` buffer (``_tbe.WEIGHTS``: width ``dim``;
        ``_tbe.STATE``: the optimizer state's width), first row there of each of its tables) for the
        group's tables in that kernel, or None (then they are read table by table)."""
        tbe = self.kernels[module_index].emb_module
        key = (module_index, id(g), prefix)
        cached = self.views.get(key)
        if cached is not None:
            attr, pointer, view = cached
            if _tbe.buffer(tbe, attr).data_ptr() == pointer:  # the kernel kept its buffer
                return view
        found = _tbe.flat_buffer(tbe, prefix)
        if found is None:
            return None
        width = g.dim if prefix == _tbe.WEIGHTS else g.state_width
        attr, offsets = found
        offsets = offsets.to(self.device)
        mine = g.kernel_table[g.table_module == module_index]
        phases = torch.unique(offsets[mine] % width)  # tables of other widths may shift the rows
        if phases.numel() != 1:
            return None
        phase = int(phases)
        flat = _tbe.buffer(tbe, attr).detach().view(-1)
        rows = (flat.numel() - phase) // width
        view = (flat[phase : phase + rows * width].view(rows, width), (offsets - phase) // width)
        self.views[key] = (attr, flat.data_ptr(), view)
        return view

    def read(self, g: HetGroup, ids: torch.Tensor, prefix: str = _tbe.WEIGHTS) -> torch.Tensor:
        """Rows of owned fused ids from the local shards (``prefix=_tbe.STATE``: their optimizer state)."""
        width = g.dim if prefix == _tbe.WEIGHTS else g.state_width
        tables = g.table_of(ids)
        rows = g.local_rows(ids, tables)
        out = None
        for module_index in g.modules:
            view = self.view(module_index, g, prefix)
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
            weights = [m.split_embedding_weights() for m in self.kernels]
            return g.read_owned(ids, [weights[t.module_index][t.table_index] for t in g.tables])
        tables = g.table_of(ids)
        rows = g.local_rows(ids, tables)
        out = torch.empty(ids.numel(), g.state_width, device=self.device)
        for i in torch.unique(tables).tolist():
            t, mine = g.tables[i], tables == i
            out[mine] = _tbe.row_state(self.kernels[t.module_index].emb_module, t.table_index)[1][rows[mine]].float()
        return out

    def fetched(self, g: HetGroup, ids: torch.Tensor) -> torch.Tensor:
        """What an owner sends for each requested row: the row, then its optimizer state where the
        requester's cache keeps one (``g.fetch_width`` floats)."""
        rows = self.read(g, ids)
        if not g.state_width:
            return rows
        return torch.cat([rows, self.read(g, ids, _tbe.STATE)], 1)
