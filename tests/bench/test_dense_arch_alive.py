"""Why the converge preset's AUC jumped, and that the data model no longer makes it jump; one process, no ranks.

The benchmark's DLRM reads dense features through a dense arch whose last layer is a ReLU. On the raw
log(1 + count) features (values up to ~10), Adagrad's first steps drove every unit of that layer below
zero for every sample, seed 0 within 100 steps: no dense signal and no gradient reached the dense arch,
the model learned from sparse-sparse dot products alone (AUC ~0.78), and its AUC jumped by ~0.02 whenever
a unit happened to come back to life, a moment float rounding decided (docs/measuring.md). On standardized
features (the data model now) units stay alive.
"""

import torch
import torchrec
from torchrec import EmbeddingBagCollection

from torchrec_het_bench.data import DataConfig, SyntheticCriteo
from torchrec_het_bench.model import build_dlrm, table_configs
from torchrec_het_bench.presets import get_preset
from torchrec_het_bench.table_init import init_tables_by_row

STEPS = 100


def _live_dense_units(standardize_dense: bool, seed: int = 0) -> int:
    """Units of the dense arch's output that are positive for some held-out sample after STEPS steps of the
    converge preset's training (both ranks' batches in one process; row-wise Adagrad on the tables, Adagrad
    on the rest, at the preset's learning rate, as the benchmark's fused optimizers do)."""
    torch.manual_seed(0)
    preset = get_preset("converge")
    source = SyntheticCriteo(
        DataConfig(
            table_sizes=preset.table_sizes,
            batch_size=preset.batch_size,
            alpha=preset.alpha,
            seed=seed,
            standardize_dense=standardize_dense,
        )
    )
    model = build_dlrm(preset, source.feature_names, source.num_dense, seed)  # the benchmark's dense initialization
    tables = table_configs(preset, source.feature_names)
    model.model.sparse_arch.embedding_bag_collection = EmbeddingBagCollection(tables=tables)
    init_tables_by_row(model, tables, seed)
    sparse = list(model.model.sparse_arch.parameters())
    dense = [p for p in model.parameters() if all(p is not q for q in sparse)]
    optimizers = [
        torchrec.optim.RowWiseAdagrad(sparse, lr=preset.learning_rate),
        torch.optim.Adagrad(dense, lr=preset.learning_rate),
    ]
    for step in range(STEPS):
        for optimizer in optimizers:
            optimizer.zero_grad()
        for rank in range(2):
            loss, _ = model(source.batch(step, rank, "train"))
            (loss / 2).backward()
        for optimizer in optimizers:
            optimizer.step()
    with torch.no_grad():
        held_out = torch.cat([source.batch(i, 0, "eval").dense_features for i in range(4)])
        return int((model.model.dense_arch(held_out) > 0).any(0).sum())


def test_raw_dense_features_kill_the_dense_arch_and_standardized_ones_do_not():
    assert _live_dense_units(standardize_dense=False) == 0  # what made the converge preset jump
    assert _live_dense_units(standardize_dense=True) >= 2
