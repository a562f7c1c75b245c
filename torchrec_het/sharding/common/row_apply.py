"""Applying given row gradients through an FBGEMM table-batched kernel, and replica kernels.

The plugin's lookups compute row gradients themselves (after exchanging them) and let
the table's own fused kernel apply its optimizer: every (row, gradient) pair becomes a
bag of one row whose pooled output receives that gradient (for an unpooled kernel,
``PoolingMode.NONE`` as in TorchRec's EmbeddingCollection, the output row of that one
index does). The kernel sums the gradients of a row and steps its optimizer once,
exactly as in a stock backward.
"""

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

# Optimizers whose step on a row depends only on that row's gradient and state (no global
# step counter), so two kernels given the same gradients keep identical copies.
ROW_LOCAL_OPTIMIZERS = ("sgd", "exact_sgd", "exact_adagrad", "exact_row_wise_adagrad", "row_wise_adagrad")


@torch.no_grad()
def apply_row_grads(tbe: SplitTableBatchedEmbeddingBagsCodegen, tables: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
    """One optimizer step of ``tbe``: row ``rows[i]`` of its table ``tables[i]`` gets ``grads[i]``.

    Several gradients for one row are summed by the kernel and applied once.
    """
    if rows.numel() == 0:
        return
    device = tbe.current_device
    tables, rows, grads = tables.to(device), rows.to(device), grads.to(device)
    feature_table = list(tbe.feature_table_map)
    dims = [spec[1] for spec in tbe.embedding_specs]
    first_feature = torch.tensor([feature_table.index(t) for t in range(len(dims))], device=device)
    feature = first_feature[tables]
    order = torch.sort(feature, stable=True).indices
    feature, rows, grads = feature[order], rows[order], grads[order]
    per_feature = torch.bincount(feature, minlength=len(feature_table))
    batch = int(per_feature.max())
    lengths = (torch.arange(batch, device=device).unsqueeze(0) < per_feature.unsqueeze(1)).long().view(-1)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), torch.cumsum(lengths, 0)])
    if tbe.pooling_mode == PoolingMode.NONE:  # one output row per index, in index (= sorted) order
        with torch.enable_grad():
            rows_out = tbe(rows.long(), offsets)
        rows_out.backward(grads.to(rows_out.dtype))
        return
    feature_dims = torch.tensor([dims[t] for t in feature_table], device=device)
    column = torch.cumsum(feature_dims, 0) - feature_dims
    position = torch.arange(rows.numel(), device=device) - (torch.cumsum(per_feature, 0) - per_feature)[feature]
    out_grad = torch.zeros(batch, sum(dims[t] for t in feature_table), device=device)
    dim = grads.size(1)
    out_grad[position.unsqueeze(1), column[feature].unsqueeze(1) + torch.arange(dim, device=device)] = grads.float()
    with torch.enable_grad():
        pooled = tbe(rows.long(), offsets)
    pooled.backward(out_grad.to(pooled.dtype))


def accumulates_squares(tbe: SplitTableBatchedEmbeddingBagsCodegen) -> bool:
    """Whether the kernel's optimizer keeps a running sum of squared gradients (the Adagrad family)."""
    return "adagrad" in str(getattr(tbe.optimizer, "value", tbe.optimizer)).lower()


def check_row_local(tbe: SplitTableBatchedEmbeddingBagsCodegen, what: str) -> None:
    """ValueError unless the kernel's optimizer keeps copies identical under identical gradients."""
    name = str(getattr(tbe.optimizer, "value", tbe.optimizer)).lower()
    if name not in ROW_LOCAL_OPTIMIZERS:
        raise ValueError(f"{what}: fused optimizer {name!r} is not supported; use one of {ROW_LOCAL_OPTIMIZERS}")


def replica_kernel(
    shard: SplitTableBatchedEmbeddingBagsCodegen, rows_per_table: list[int], fused_params: dict
) -> SplitTableBatchedEmbeddingBagsCodegen:
    """A kernel shaped like ``shard`` (same tables, features, optimizer and settings, on its
    device: host memory on the CPU, device memory on CUDA) with ``rows_per_table`` rows per
    table (at least one: FBGEMM needs non-empty tables)."""
    dims = [spec[1] for spec in shard.embedding_specs]
    params = {k: v for k, v in fused_params.items() if k != "enable_raw_embedding_streaming"}
    device = shard.current_device
    if device.type == "cpu":
        location, compute = EmbeddingLocation.HOST, ComputeDevice.CPU
    else:
        location, compute = EmbeddingLocation.DEVICE, ComputeDevice.CUDA
    return SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(max(1, n), d, location, compute) for n, d in zip(rows_per_table, dims)],
        feature_table_map=list(shard.feature_table_map),
        pooling_mode=shard.pooling_mode,
        weights_precision=shard.weights_precision,
        device=device,
        **params,
    )


def row_state(tbe: SplitTableBatchedEmbeddingBagsCodegen, table: int) -> list[torch.Tensor]:
    """The table's weights and optimizer states as ``[rows, k]`` views (k = dim or 1)."""
    weights = tbe.split_embedding_weights()[table]
    rows = weights.size(0)
    sgd = str(getattr(tbe.optimizer, "value", tbe.optimizer)).lower() in ("sgd", "exact_sgd")
    states = [] if sgd else tbe.split_optimizer_states()[table]
    return [weights] + [s.view(rows, -1) for s in states]
