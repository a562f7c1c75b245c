"""The benchmark's workloads: which data and which model a configuration trains.

``dlrm``: the DLRM over Criteo-like pooled features (``model.py``, ``torchrec_het_bench.data``).
``sequence``: the target-attention ranker over unpooled item histories
(``sequence_model.py``, ``torchrec_het_bench.data.sequence``).
"""

import torch.distributed as dist

from torchrec_het_bench.config_types import BenchConfig
from torchrec_het_bench.data import DataConfig, open_source
from torchrec_het_bench.data.sequence import SequenceDataConfig, SyntheticSequences
from torchrec_het_bench.model import ShardedModel, shard_dlrm
from torchrec_het_bench.presets import BenchPreset
from torchrec_het_bench.sequence_model import shard_sequence

WORKLOADS = ("dlrm", "sequence")


def check_workload(name: str) -> None:
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {WORKLOADS}")


def sequence_data_config(preset: BenchPreset, seed: int) -> SequenceDataConfig:
    """The sequence stream a preset trains on."""
    if preset.sequence is None:
        raise ValueError(f"preset {preset.name!r} has no sequence workload")
    s = preset.sequence
    return SequenceDataConfig(
        item_rows=s.item_rows,
        category_rows=s.category_rows,
        batch_size=s.batch_size,
        history_length=s.history_length,
        min_history_length=s.min_history_length,
        alpha=preset.alpha,
        seed=seed,
    )


def open_workload_source(workload: str, preset: BenchPreset, world_size: int, seed: int, data_path: str | None = None):
    """The batches of ``workload``: ``batch(step, rank, split)`` for every rank.

    ``data_path`` (Criteo files) applies to the DLRM only; the sequence data is synthetic.
    """
    check_workload(workload)
    if workload == "sequence":
        return SyntheticSequences(sequence_data_config(preset, seed), world_size=world_size)
    config = DataConfig(table_sizes=preset.table_sizes, batch_size=preset.batch_size, alpha=preset.alpha, seed=seed)
    return open_source(data_path, config, world_size=world_size)


def shard_workload(
    config: BenchConfig,
    preset: BenchPreset,
    source,
    embedding_optimizer: str,
    local_world_size: int,
    seed: int,
    link_bytes_per_s: float | None = None,
) -> ShardedModel:
    """A fresh model of ``config``'s workload, sharded as ``config`` says (``link_bytes_per_s``:
    the run's network, for configurations that plan for it)."""
    check_workload(config.workload)
    sample = training_sample(source, preset)
    if config.workload == "sequence":
        return shard_sequence(
            config,
            preset,
            embedding_optimizer,
            local_world_size,
            seed=seed,
            sample=sample,
            link_bytes_per_s=link_bytes_per_s,
        )
    return shard_dlrm(
        config,
        preset,
        source.feature_names,
        source.num_dense,
        embedding_optimizer,
        local_world_size,
        seed=seed,
        sample=sample,
        link_bytes_per_s=link_bytes_per_s,
    )


PROFILE_EVERY = 20  # FAE's profile: a 5% sample of the training steps


_SAMPLES: dict = {}  # (source, preset) -> their sample function: one per run, so its profile is counted once


def training_sample(source, preset: BenchPreset):
    """This rank's every-20th training batch (sparse features), built only when asked for; the same
    function for the same source and preset (:func:`~torchrec_het_bench.replicated_configs.stream_profile`
    counts each once)."""
    key = (id(source), preset)
    if key in _SAMPLES:
        return _SAMPLES[key][1]

    def sample():
        rank = dist.get_rank()
        return [
            source.batch(step, rank, "train").sparse_features for step in range(0, preset.total_steps, PROFILE_EVERY)
        ]

    _SAMPLES[key] = (source, sample)  # the source held: its id is not reused while the key is here
    return sample
