"""apply_rows updates a kernel's rows as FBGEMM's own fused CPU optimizer does; step_rows, the
arithmetic under it, steps dense copies of rows (the replica blocks') the same way."""

from types import SimpleNamespace

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

from torchrec_het.sharding.row_apply import apply_row_grads
from torchrec_het.sharding.row_optim import _layout, apply_rows, optimizer_kind, step_rows

SPECS = [(13, 8), (9, 16), (21, 8)]  # (rows, dim): tables 0 and 2 share a width
OPTIMIZERS = {
    "sgd": (EmbOptimType.EXACT_SGD, {}),
    "adagrad": (EmbOptimType.EXACT_ADAGRAD, {"eps": 1e-8}),
    "rowwise_adagrad": (EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"eps": 1e-8}),
    "rowwise_adagrad_l2": (EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"eps": 1e-6, "weight_decay": 0.05,
                                                                "weight_decay_mode": 1}),
    "rowwise_adagrad_decoupled": (EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"eps": 1e-6, "weight_decay": 0.05,
                                                                       "weight_decay_mode": 2}),
}


def _kernel(optimizer: str, seed: int = 0) -> SplitTableBatchedEmbeddingBagsCodegen:
    from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode

    kind, kwargs = OPTIMIZERS[optimizer]
    kwargs = dict(kwargs)
    if "weight_decay_mode" in kwargs:
        kwargs["weight_decay_mode"] = WeightDecayMode(kwargs["weight_decay_mode"])
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for rows, dim in SPECS],
        optimizer=kind,
        learning_rate=0.3,
        device=torch.device("cpu"),
        **kwargs,
    )
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        tbe.weights_host.copy_(torch.randn(tbe.weights_host.shape, generator=generator))
    return tbe


def _state(tbe) -> list[torch.Tensor]:
    states = [] if optimizer_kind(tbe) == "sgd" else [s.clone() for table in tbe.split_optimizer_states() for s in table]
    return [w.clone() for w in tbe.split_embedding_weights()] + states


def _steps(tables: list[int]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Three steps of (tables, rows, grads) over tables of one width, with repeated rows."""
    generator = torch.Generator().manual_seed(5)
    out = []
    for _ in range(3):
        table = torch.tensor(tables)[torch.randint(0, len(tables), (40,), generator=generator)]
        rows = torch.randint(0, 9, (40,), generator=generator)  # repeats: 40 draws from few rows
        grads = torch.randn(40, SPECS[tables[0]][1], generator=generator)
        out.append((table, rows, grads))
    return out


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_apply_rows_matches_the_fused_kernel(optimizer: str) -> None:
    mine, theirs = _kernel(optimizer), _kernel(optimizer)
    # the vectorized path; with weight decay the kernel itself
    assert (_layout(mine) is None) == ("weight_decay" in OPTIMIZERS[optimizer][1])
    for tables in ([0, 2], [1]):  # a call updates tables of one width
        for table, rows, grads in _steps(tables):
            apply_rows(mine, table, rows, grads)
            apply_row_grads(theirs, table, rows, grads)  # FBGEMM's kernel: forward + backward on bags of one
    moved = False
    for got, want, before in zip(_state(mine), _state(theirs), _state(_kernel(optimizer))):
        if optimizer in ("sgd", "adagrad"):
            assert torch.equal(got, want)  # bit for bit
        else:  # FBGEMM's AVX kernel sums a row's squares in vector lanes: now and then the last bit differs
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-7)
        moved |= not torch.equal(want, before)
    assert moved


def test_optimizer_kind_names_unsupported_ones() -> None:
    assert optimizer_kind(_kernel("rowwise_adagrad")) == "rowwise_adagrad"
    with pytest.raises(ValueError, match="adam"):  # FBGEMM's CPU kernels have no Adam; a stand-in kernel
        optimizer_kind(SimpleNamespace(optimizer=EmbOptimType.ADAM))


def test_nothing_to_apply_changes_nothing() -> None:
    tbe = _kernel("rowwise_adagrad")
    before = _state(tbe)
    none = torch.zeros(0, dtype=torch.int64)
    apply_rows(tbe, none, none, torch.zeros(0, 8))
    assert all(torch.equal(a, b) for a, b in zip(_state(tbe), before))


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "rowwise_adagrad"])
def test_step_rows_on_copies_matches_apply_rows_bit_for_bit(optimizer: str) -> None:
    """Dense copies of tables 0 and 2 stepped as a replica block steps them (a learning rate and
    a float64 epsilon per row) end where the kernel's own rows end under apply_rows."""
    tbe = _kernel(optimizer)
    kind, eps = optimizer_kind(tbe), OPTIMIZERS[optimizer][1].get("eps", 0.0)
    tables = [0, 2]
    weights = torch.cat([tbe.split_embedding_weights()[t] for t in tables]).clone()
    if kind == "sgd":
        state = torch.zeros(weights.size(0), 0)
    else:
        state = torch.cat([tbe.split_optimizer_states()[t][0].view(SPECS[t][0], -1) for t in tables]).clone()
    first = torch.tensor([0, SPECS[0][0]])  # each table's first row in the copies
    for table, rows, grads in _steps(tables):
        position = table.eq(2).long()
        copies, inverse = torch.unique(first[position] + rows, return_inverse=True)
        summed = torch.zeros(copies.numel(), grads.size(1)).index_add_(0, inverse, grads)
        lr = tbe.learning_rate_tensor.expand(copies.numel()).reshape(-1, 1)
        per_row_eps = torch.full((copies.numel(), 1), eps, dtype=torch.float64)
        new_weights, new_state = step_rows(kind, weights[copies], state[copies], summed, lr, per_row_eps)
        weights[copies], state[copies] = new_weights, new_state
        apply_rows(tbe, table, rows, grads)
    assert torch.equal(weights, torch.cat([tbe.split_embedding_weights()[t] for t in tables]))
    if kind != "sgd":
        assert torch.equal(state, torch.cat([tbe.split_optimizer_states()[t][0].view(SPECS[t][0], -1) for t in tables]))
    assert not torch.equal(weights, torch.cat([_kernel(optimizer).split_embedding_weights()[t] for t in tables]))


def test_step_rows_names_an_optimizer_it_cannot_step() -> None:
    with pytest.raises(ValueError, match="adam"):
        step_rows("adam", torch.zeros(1, 4), torch.zeros(1, 4), torch.zeros(1, 4), torch.ones(()), 1e-8)
