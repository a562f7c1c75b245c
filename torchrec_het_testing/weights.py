"""A model's tables whatever their sharding: set them, read them back whole, compare them.

Tests start every model of a comparison from the same weights: :func:`seeded_tables` draws
each table whole (TorchRec's default range, from the seed and the table's name) and
:func:`set_tables` writes them into a model's local shards, so any plan of the same tables
starts alike. :func:`full_tables` reads a sharded model's tables back whole.
"""

import zlib

import torch
import torch.distributed as dist


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest absolute difference over the largest magnitude of ``want`` (0.0 for empty tensors)."""
    if want.numel() == 0:
        return 0.0
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-6))


def seeded_tables(configs, seed: int) -> dict[str, torch.Tensor]:
    """Each table's weights, uniform in TorchRec's default range ``+-1/sqrt(rows)``, drawn from
    (``seed``, the table's name): the same for a table whatever else the model holds."""
    out = {}
    for config in configs:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(config.name.encode()))
        bound = config.num_embeddings**-0.5
        weights = torch.rand(config.num_embeddings, config.embedding_dim, generator=generator)
        out[config.name] = weights * 2 * bound - bound
    return out


def _table_entries(model: torch.nn.Module, names) -> dict[str, object]:
    """Table name -> its entry of ``model.state_dict()`` (a tensor or a ShardedTensor)."""
    out = {}
    for key, value in model.state_dict().items():
        parts = key.split(".")
        if len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in names:
            out[parts[-2]] = value
    return out


@torch.no_grad()
def set_tables(model: torch.nn.Module, tables: dict[str, torch.Tensor]) -> None:
    """Writes each whole table of ``tables`` into ``model``'s local shards of it (or its unsharded weight).

    Raises:
        KeyError: a table of ``tables`` is not in the model's state dict.
    """
    entries = _table_entries(model, set(tables))
    missing = sorted(set(tables) - set(entries))
    if missing:
        raise KeyError(f"no weights for table(s) {missing} in the model's state dict")
    for name, value in entries.items():
        whole = tables[name]
        if hasattr(value, "local_shards"):
            for shard in value.local_shards():
                (row, col), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                shard.tensor.copy_(whole[row : row + rows, col : col + cols])
        else:
            value.copy_(whole)


def full_tables(model: torch.nn.Module, configs) -> dict[str, torch.Tensor]:
    """Every table of ``configs`` whole, on the CPU: a sharded one's shards summed into place over
    the ranks (a collective; ``state_dict()`` first applies what a plugin type still holds back)."""
    by_name = {c.name: c for c in configs}
    out, sharded = {}, {}
    for name, value in _table_entries(model, set(by_name)).items():
        if not hasattr(value, "local_shards"):
            out[name] = value.detach().float().cpu()
            continue
        config, device = by_name[name], next((s.tensor.device for s in value.local_shards()), torch.device("cpu"))
        whole = torch.zeros(config.num_embeddings, config.embedding_dim, device=device)
        for shard in value.local_shards():
            (row, col), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            whole[row : row + rows, col : col + cols] += shard.tensor.detach().float()
        sharded[name] = whole
    names = sorted(sharded)  # the same order on every rank
    if names and dist.is_initialized() and dist.get_world_size() > 1:
        flat = torch.cat([sharded[name].flatten() for name in names])  # one collective for them all
        dist.all_reduce(flat)
        parts = flat.split([sharded[name].numel() for name in names])
        sharded = {name: part.view_as(sharded[name]) for name, part in zip(names, parts)}
    out.update({name: sharded[name].cpu() for name in names})
    return out
