"""apply_rows updates a kernel's rows as FBGEMM's own fused CPU optimizer does; step_rows, the
arithmetic under it, steps dense copies of rows (the replica blocks') the same way."""

from types import SimpleNamespace

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen

from torchrec_het._tbe import apply_row_grads, apply_rows, kernel_layout, optimizer_kind, step_rows

SPECS = [(13, 8), (9, 16), (21, 8)]  # (rows, dim): tables 0 and 2 share a width
OPTIMIZERS = {
    "sgd": (EmbOptimType.EXACT_SGD, {}),
    "adagrad": (EmbOptimType.EXACT_ADAGRAD, {"eps": 1e-8}),
    "rowwise_adagrad": (EmbOptimType.EXACT_ROWWISE_ADAGRAD, {"eps": 1e-8}),
    "rowwise_adagrad_l2": (
        EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        {"eps": 1e-6, "weight_decay": 0.05, "weight_decay_mode": 1},
    ),
    "rowwise_adagrad_decoupled": (
        EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        {"eps": 1e-6, "weight_decay": 0.05, "weight_decay_mode": 2},
    ),
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
    states = (
        [] if optimizer_kind(tbe) == "sgd" else [s.clone() for table in tbe.split_optimizer_states() for s in table]
    )
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
    assert (kernel_layout(mine) is None) == ("weight_decay" in OPTIMIZERS[optimizer][1])
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


# ---- held gradients (a stale replica's sync, a HET push of k updates) against k synchronous steps ----


def _k_steps(kind: str, weight, state, grads, lr, eps):
    for g in grads:
        weight, state = step_rows(kind, weight, state, g, lr, eps)
    return weight, state


def _held(kind: str, weight, state, grads, lr, eps):
    from torchrec_het._tbe import squares_of, step_rows_held

    squares = sum(squares_of(kind, g) for g in grads) if kind != "sgd" else None
    return step_rows_held(kind, weight, state, sum(grads), squares, lr, eps, len(grads))


@pytest.mark.parametrize("kind", ["adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("k", [1, 2, 5, 10])
def test_held_gradients_grow_the_state_as_k_steps_do(kind: str, k: int) -> None:
    generator = torch.Generator().manual_seed(k)
    dim = 8
    weight = torch.randn(1, dim, generator=generator)
    state = torch.rand(1, dim if kind == "adagrad" else 1, generator=generator)
    grads = [torch.randn(1, dim, generator=generator) for _ in range(k)]
    lr, eps = torch.tensor(0.1), 1e-8
    sync_weight, sync_state = _k_steps(kind, weight, state, grads, lr, eps)
    held_weight, held_state = _held(kind, weight, state, grads, lr, eps)
    torch.testing.assert_close(held_state, sync_state, rtol=1e-6, atol=1e-7)
    square_of_sum = step_rows(kind, weight, state, sum(grads), lr, eps)[1]
    if k > 1:  # the rule it replaces: the square of the sum
        assert not torch.allclose(square_of_sum, sync_state, rtol=1e-3)
    if k == 1:
        torch.testing.assert_close(held_weight, sync_weight, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["adagrad", "rowwise_adagrad"])
@pytest.mark.parametrize("k", [2, 5, 10])
def test_held_step_is_bounded_by_the_k_steps_for_gradients_of_one_sign(kind: str, k: int) -> None:
    generator = torch.Generator().manual_seed(100 + k)
    dim = 8
    weight = torch.randn(1, dim, generator=generator)
    state = torch.rand(1, dim if kind == "adagrad" else 1, generator=generator) + 0.5
    grads = [torch.rand(1, dim, generator=generator) + 0.1 for _ in range(k)]  # positive
    lr, eps = torch.tensor(0.1), 1e-8
    sync_weight, sync_state = _k_steps(kind, weight, state, grads, lr, eps)
    held_weight, _ = _held(kind, weight, state, grads, lr, eps)
    sync_step, held_step = (weight - sync_weight).double(), (weight - held_weight).double()
    first_state = step_rows(kind, weight, state, grads[0], lr, eps)[1].double()
    ratio = (first_state / sync_state.double()).sqrt()  # state after the first step / after the last
    assert bool((held_step <= sync_step * (1 + 1e-5)).all())
    assert bool((held_step >= sync_step * ratio * (1 - 1e-5)).all())


def test_held_sgd_is_the_sum_of_the_k_steps() -> None:
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(1, 8, generator=generator)
    grads = [torch.randn(1, 8, generator=generator) for _ in range(6)]
    sync_weight, _ = _k_steps("sgd", weight, None, grads, torch.tensor(0.1), 0.0)
    held_weight, _ = _held("sgd", weight, None, grads, torch.tensor(0.1), 0.0)
    torch.testing.assert_close(held_weight, sync_weight, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["adagrad", "rowwise_adagrad"])
def test_a_cancelled_estimate_of_the_squares_never_lets_a_row_jump(kind: str) -> None:
    """Holders whose held sums have opposite signs can estimate the squares at 0; k gradients that sum
    to G have squares of at least G^2 / k, so the state grows by that and the step stays bounded."""
    from torchrec_het._tbe import squares_of, step_rows_held

    k, dim = 6, 8
    weight, grad = torch.zeros(1, dim), torch.randn(1, dim, generator=torch.Generator().manual_seed(3))
    state = torch.zeros(1, dim if kind == "adagrad" else 1)
    lr = torch.tensor(0.1)
    new_weight, new_state = step_rows_held(kind, weight, state, grad, torch.zeros_like(state), lr, 1e-8, k)
    torch.testing.assert_close(new_state, (squares_of(kind, grad) / k).float())
    bound = 0.1 * k**0.5 * (1.0 if kind == "adagrad" else float(grad.abs().max() / grad.pow(2).mean().sqrt()))
    assert float(new_weight.abs().max()) <= bound * (1 + 1e-5)


@pytest.mark.parametrize("optimizer", ["adagrad", "rowwise_adagrad"])
def test_apply_rows_of_held_pushes_is_step_rows_held_on_the_rows_bit_for_bit(optimizer: str) -> None:
    """A HET owner applies pushes of held gradients (``beyond``, ``steps``) with apply_rows; the kernel's
    rows end where step_rows_held takes copies of them (row-wise Adagrad writes by adding, unread)."""
    from torchrec_het._tbe import squares_of, step_rows_held

    tbe = _kernel(optimizer)
    kind, eps = optimizer_kind(tbe), OPTIMIZERS[optimizer][1]["eps"]
    generator = torch.Generator().manual_seed(3)
    table = torch.tensor([0, 2, 0, 2, 0])
    rows = torch.tensor([4, 1, 7, 1, 4])  # repeats: the rows' pushes are summed, their spans the longest
    grads = torch.randn(5, 8, generator=generator)
    beyond = squares_of(kind, grads).double().abs() * 0.5  # each push's squares beyond its sum's
    steps = torch.tensor([1, 3, 2, 2, 4])
    # the reference, on copies: rows (table, row) in the order torch.unique gives their flat starts
    starts = tbe.weights_offsets.index_select(0, table) + rows * 8
    unique, inverse = torch.unique(starts, return_inverse=True)
    summed = torch.zeros(unique.numel(), 8).index_add_(0, inverse, grads)
    held = torch.zeros(unique.numel(), beyond.size(1), dtype=torch.float64).index_add_(0, inverse, beyond)
    held = (held + squares_of(kind, summed)).clamp(min=0)
    spans = torch.ones(unique.numel(), dtype=torch.int64).scatter_reduce(0, inverse, steps, "amax").unsqueeze(1)
    picks = [(int(table[inverse.tolist().index(i)]), int(rows[inverse.tolist().index(i)])) for i in range(len(unique))]
    weight = torch.stack([tbe.split_embedding_weights()[t][r] for t, r in picks]).clone()
    state = torch.stack([tbe.split_optimizer_states()[t][0].view(SPECS[t][0], -1)[r] for t, r in picks]).clone()
    lr = tbe.learning_rate_tensor
    want_weight, want_state = step_rows_held(kind, weight, state, summed, held, lr, eps, spans)
    apply_rows(tbe, table, rows, grads, beyond, steps)
    got_weight = torch.stack([tbe.split_embedding_weights()[t][r] for t, r in picks])
    got_state = torch.stack([tbe.split_optimizer_states()[t][0].view(SPECS[t][0], -1)[r] for t, r in picks])
    assert torch.equal(got_weight, want_weight)
    assert torch.equal(got_state, want_state)
    assert not torch.equal(got_weight, weight)
