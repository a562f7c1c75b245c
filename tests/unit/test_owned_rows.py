"""The owners' rows in FBGEMM's kernels (``sharding/common/owned_rows.py``) and the direct owner of
``het_row_replicated`` bags (``sharding/row_replicated/owner.py``): pooling and stepping a kernel's rows
in place gives what the kernel's own forward and fused backward give."""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

from torchrec_het import _tbe
from torchrec_het.sharding.common.owned_rows import OwnedRows
from torchrec_het.sharding.row_replicated.owner import DirectOwner, OwnerValues

ROWS, DIM = (40, 25, 33), 8
OPTIMIZERS = {
    "sgd": EmbOptimType.EXACT_SGD,
    "adagrad": EmbOptimType.EXACT_ADAGRAD,
    "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
}


def _kernel(optimizer: str, dims=(DIM, DIM, DIM), seed: int = 0) -> SplitTableBatchedEmbeddingBagsCodegen:
    specs = [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows, dim in zip(ROWS, dims)]
    kernel = SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=OPTIMIZERS[optimizer], learning_rate=0.3, eps=0.01)
    generator = torch.Generator().manual_seed(seed)
    for weights in kernel.split_embedding_weights():
        weights.copy_(torch.randn(weights.shape, generator=generator))
    return kernel


def _batch(seed: int, entries: int = 30):
    """Entries (bags of 1..3 values, each of one table) with their values: table, row, weight."""
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 4, (entries,), generator=generator)
    entry_table = torch.randint(0, len(ROWS), (entries,), generator=generator)
    table = torch.repeat_interleave(entry_table, sizes)
    row = (torch.rand(table.numel(), generator=generator) ** 3 * torch.tensor(ROWS)[table]).long()  # repeats
    weight = torch.rand(table.numel(), generator=generator) + 0.5
    return sizes, entry_table, table, row, weight


def _kernel_forward_backward(kernel, sizes, entry_table, table, row, weight, grads, weighted: bool):
    """The kernel's own call: one bag per (table, entry), the entries' gradients as the bags'."""
    entries, tables = sizes.numel(), len(ROWS)
    bag = torch.full((tables, entries), 0, dtype=torch.int64)
    entry_of = torch.repeat_interleave(torch.arange(entries), sizes)
    order = torch.argsort(table * entries + entry_of, stable=True)  # feature-major, then entry
    lengths = torch.zeros(tables, entries, dtype=torch.int64)
    lengths[entry_table, torch.arange(entries)] = sizes
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths.view(-1), 0)])
    pooled = kernel(row[order], offsets, per_sample_weights=weight[order] if weighted else None)
    out_grad = torch.zeros_like(pooled)
    for e in range(entries):  # test-side loop: a small reference
        t = int(entry_table[e])
        out_grad[e, t * DIM : (t + 1) * DIM] = grads[e]
    pooled.backward(out_grad)
    del bag
    return torch.stack([pooled[e, int(entry_table[e]) * DIM : (int(entry_table[e]) + 1) * DIM] for e in range(entries)])


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_direct_owner_pools_and_steps_as_the_kernel_does(optimizer: str, weighted: bool) -> None:
    stock, direct = _kernel(optimizer), _kernel(optimizer)
    owner = DirectOwner.of([direct], [DIM] * len(ROWS), torch.zeros(len(ROWS), dtype=torch.int64),
                           torch.arange(len(ROWS)), torch.device("cpu"))  # fmt: skip
    assert owner is not None
    for step in range(3):
        sizes, entry_table, table, row, weight = _batch(step)
        grads = torch.randn(sizes.numel(), DIM, generator=torch.Generator().manual_seed(100 + step))
        want = _kernel_forward_backward(stock, sizes, entry_table, table, row, weight, grads, weighted)
        entry_of = torch.repeat_interleave(torch.arange(sizes.numel()), sizes)
        values = OwnerValues(row, entry_of, weight if weighted else None, entry_table)  # position = table here
        batch = owner.plan(values)
        got = owner.pool(batch)
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-6)
        owner.step(batch, grads.reshape(-1).clone())
        for w_stock, w_direct in zip(stock.split_embedding_weights(), direct.split_embedding_weights()):
            torch.testing.assert_close(w_direct, w_stock, rtol=1e-6, atol=1e-6)
        if optimizer != "sgd":
            for s_stock, s_direct in zip(stock.split_optimizer_states(), direct.split_optimizer_states()):
                torch.testing.assert_close(s_direct[0], s_stock[0], rtol=1e-6, atol=1e-6)


def test_the_kernels_call_serves_where_rows_are_not_one_view_or_not_steppable() -> None:
    cpu, tables = torch.device("cpu"), torch.arange(len(ROWS))
    mixed = _kernel("rowwise_adagrad", dims=(8, 4, 8))
    assert DirectOwner.of([mixed], [8, 4, 8], torch.zeros(3, dtype=torch.int64), tables, cpu) is None
    specs = [(rows, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows in ROWS]
    half = SplitTableBatchedEmbeddingBagsCodegen(specs, optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                                 weights_precision=SparseType.FP16)  # fmt: skip
    assert DirectOwner.of([half], [DIM] * 3, torch.zeros(3, dtype=torch.int64), tables, cpu) is None
    view = OwnedRows([half], cpu).view(0, DIM)
    assert view is not None and view.kind is None  # readable, not steppable here (fp16 rows)
    assert torch.equal(view.weights[view.first_row[1] + 3], half.split_embedding_weights()[1][3])


def test_views_follow_a_kernel_that_got_new_buffers() -> None:
    kernel = _kernel("rowwise_adagrad")
    owned = OwnedRows([kernel], torch.device("cpu"))
    first = owned.view(0, DIM)
    assert owned.view(0, DIM) is first  # made once while the kernel keeps its buffers
    kernel.weights_host = torch.nn.Parameter(kernel.weights_host.detach().clone() + 1.0)  # as a load may replace it
    second = owned.view(0, DIM)
    assert second is not first and torch.equal(second.weights[0], kernel.split_embedding_weights()[0][0])


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("dims", [(DIM, DIM, DIM), (8, 4, 8)], ids=["one_view", "several_phases"])
def test_rows_read_and_written_by_table_and_row(optimizer: str, dims) -> None:
    """Through the view, or element by element where a width's tables sit at several phases (8, 4, 8:
    the second 8-wide table starts 4 floats off), the rows and state read are the kernel's own and a
    write lands on those rows only."""
    kernel = _kernel(optimizer, dims=dims)
    for state in kernel.split_optimizer_states():
        state[0].copy_(torch.rand(state[0].shape, generator=torch.Generator().manual_seed(7)))
    owned = OwnedRows([kernel], torch.device("cpu"))
    several = dims == (8, 4, 8)
    assert (owned.view(0, 8) is None) == several
    tables, rows = torch.tensor([2, 0, 2 if several else 1]), torch.tensor([5, 7, 0])  # tables of width 8
    states = [s[0].view(r, -1) for s, r in zip(kernel.split_optimizer_states(), ROWS)]
    for part, shards in ((_tbe.WEIGHTS, kernel.split_embedding_weights()), (_tbe.STATE, states)):
        want = torch.stack([shards[t][r] for t, r in zip(tables.tolist(), rows.tolist())])
        assert torch.equal(owned.read(0, 8, tables, rows, part), want)
        before = [s.clone() for s in shards]
        new = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
        owned.write(0, 8, tables, rows, new, part)
        assert torch.equal(owned.read(0, 8, tables, rows, part), new)
        for t, (now, then) in enumerate(zip(shards, before)):
            untouched = torch.ones(now.size(0), dtype=torch.bool)
            untouched[rows[tables == t]] = False
            assert torch.equal(now[untouched], then[untouched])
