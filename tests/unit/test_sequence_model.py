"""The benchmark's sequence model, unsharded: padding, masking, and that it learns the planted signal."""

from dataclasses import replace

import pytest
import torch
from torchrec.sparse.jagged_tensor import JaggedTensor

from torchrec_het_bench.data import binary_auc
from torchrec_het_bench.data.sequence import SyntheticSequences
from torchrec_het_bench.presets import get_preset
from torchrec_het_bench.sequence_model import _padded, build_sequence_model, sequence_table_configs
from torchrec_het_bench.workloads import sequence_data_config


@pytest.fixture(autouse=True)
def one_thread():
    """Small tensors: one thread is as fast, and immune to OpenMP spinning when other processes hold the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_padding_keeps_every_row_in_place_and_masks_the_rest():
    values = torch.arange(12, dtype=torch.float32).view(6, 2)
    padded, mask = _padded(JaggedTensor(values=values, lengths=torch.tensor([1, 0, 3, 2])), max_length=3)
    assert padded.shape == (4, 3, 2)
    assert mask.tolist() == [[True, False, False], [False, False, False], [True, True, True], [True, True, False]]
    assert torch.equal(padded[mask], values)
    assert (padded[~mask] == 0).all()
    full, full_mask = _padded(JaggedTensor(values=values, lengths=torch.tensor([3, 3])), max_length=3)
    assert torch.equal(full.reshape(6, 2), values) and full_mask.all()


def test_tables_share_items_and_categories():
    tables = {t.name: t for t in sequence_table_configs(get_preset("smoke").sequence)}
    assert tables["t_item"].feature_names == ["hist_item", "target_item"]
    assert tables["t_cat"].feature_names == ["hist_cat", "target_cat"]


def test_small_model_learns_the_planted_signal():
    preset = get_preset("smoke")
    preset = replace(preset, sequence=replace(preset.sequence, item_rows=2_000, category_rows=50, history_length=10))
    source = SyntheticSequences(sequence_data_config(preset, seed=0))
    model = build_sequence_model(preset.sequence, seed=0, device=torch.device("cpu"))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(200):
        loss, _ = model(source.batch(step, 0))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        pairs = [source.batch_and_logits(i, 0, "eval") for i in range(8)]
        scores = torch.cat([model(batch)[1][1] for batch, _ in pairs])
    labels = torch.cat([batch.labels for batch, _ in pairs])
    oracle = binary_auc(torch.cat([logits for _, logits in pairs]), labels)
    learned = binary_auc(scores, labels)
    # What the target alone tells (its planted main effect): the model must do better,
    # so it uses the history.
    target_only = SyntheticSequences(replace(source.config, interaction_signal=0.0))
    alone = binary_auc(torch.cat([target_only.true_logits(i, 0, "eval") for i in range(8)]), labels)
    print(f"held-out AUC {learned:.4f} (true logits {oracle:.4f}, target effect alone {alone:.4f})")
    assert learned > 0.5 + 0.6 * (oracle - 0.5)
    assert learned > alone + 0.1
