"""A deterministic, random-access Criteo-like stream with a planted, learnable label model.

Every batch is a pure function of (seed, split, rank, step): its generator is seeded from
their hash, so any step can be produced in any order, on any rank, any number of times.

Features:
    * sparse: ``cat_i`` ids are Zipf(alpha) over table i's rows (see ``zipf.py``); bags
      hold 1 id (one-hot) or 1 + Poisson(pooling_factor - 1) ids, capped. Optional
      ``seq_j`` keys follow in the same KJT with histories of 1..sequence_length ids.
    * dense: Criteo-like log(1 + c) of counts c = floor(exp(m_j + s_j * z_j)), z_j ~ N(0, 1), with
      fixed per-feature m_j, s_j, standardized to mean 0 and variance 1 per feature (the exact
      moments of log(1 + c), :func:`log_count_moments`), as a data loader's normalization would;
      ``standardize_dense=False`` keeps the raw values (0..~10), on which the benchmark's DLRM
      (ReLU dense arch, Adagrad) often loses every unit of its dense arch in its first steps.
    * labels: Bernoulli(sigmoid(logit)) with
      logit = bias + Σ_tables a * effect_t(bag) + w · z + Σ_pairs b * pair_t(bag) * pair_u(bag),
      where effect_t(id) ~ N(0, 1) is computed from (seed, table, id) by an integer hash
      (nothing stored per row), a bag's effect is the (weighted) mean over its ids, and
      the bias is calibrated so the mean label is ``base_ctr``. Sequence keys carry no
      signal. Hot rows recur often, so a model that learns their embeddings recovers
      most of the categorical signal.
"""

import math

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het_bench.data.config import DataConfig
from torchrec_het_bench.data.source import check_request
from torchrec_het_bench.data.zipf import ZipfTables, splitmix64

_SPLIT_CODES = {"train": 1, "eval": 2}
_CALIBRATION_CODE = 3
_CALIBRATION_SAMPLES = 1 << 15
_CALIBRATION_CHUNK = 4096
_MASK32 = 0xFFFFFFFF
_EFFECT_SALT, _PAIR_SALT = 1, 2


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash of int64 values in [0, 2**32); products stay below 2**59."""
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _MASK32
    return (x >> 16) ^ x


def hashed_normal(ids: torch.Tensor, salts: torch.Tensor) -> torch.Tensor:
    """A standard-normal value per id, a pure function of (salt, id) (float64).

    Args:
        ids: int64 ids in [0, 2**31).
        salts: int64 salt in [0, 2**32) per id (one per table and purpose).
    """
    h = hash32(hash32(ids ^ salts) ^ salts)
    return torch.special.ndtri((h.to(torch.float64) + 0.5) / 2.0**32)


class SyntheticCriteo:
    """Criteo-like batches with Zipf-skewed ids and a planted click model.

    Args:
        config: shape, skew, signal and seed of the stream.

    Attributes:
        feature_names: pooled keys ``cat_0..`` (one table each).
        table_sizes: rows of each ``cat_*`` table.
        sequence_feature_names: keys ``seq_0..`` that follow the ``cat_*`` keys in the KJT.
        sequence_table_sizes: rows of each ``seq_*`` table.
        num_dense: dense features per sample.
    """

    def __init__(self, config: DataConfig) -> None:
        self.config = config
        self.feature_names = config.feature_names
        self.table_sizes = list(config.table_sizes)
        self.sequence_feature_names = config.sequence_feature_names
        self.sequence_table_sizes = config.sequence_table_sizes
        self.num_dense = config.num_dense
        self._keys = self.feature_names + self.sequence_feature_names
        generator = torch.Generator().manual_seed(splitmix64(config.seed, 0))
        self._ids = ZipfTables(self.table_sizes + self.sequence_table_sizes, config.alpha, generator)
        self._dense_log_mean = torch.empty(config.num_dense).uniform_(0.5, 4.0, generator=generator)
        self._dense_log_std = torch.empty(config.num_dense).uniform_(0.5, 1.5, generator=generator)
        self._dense_center, self._dense_scale = log_count_moments(self._dense_log_mean, self._dense_log_std)
        weights = torch.randn(config.num_dense, dtype=torch.float64, generator=generator)
        self._dense_weights = weights * (config.dense_signal / weights.norm().clamp_min(1e-12))
        num_tables = len(self.table_sizes)
        self._effect_salts = self._salts(_EFFECT_SALT, num_tables)
        self._pair_salts = self._salts(_PAIR_SALT, num_tables)
        self._effect_scale = config.categorical_signal / math.sqrt(num_tables)
        pairs = config.pairs
        self._pair_scale = config.pair_signal / math.sqrt(len(pairs)) if pairs else 0.0
        self._bias = 0.0
        self._bias = self._calibrated_bias()

    @property
    def bias(self) -> float:
        """Logit bias that makes the mean label ``config.base_ctr``."""
        return self._bias

    @property
    def nbytes(self) -> int:
        """Bytes of state: id permutations and CDFs (everything else is negligible)."""
        return self._ids.nbytes

    def hot_rows(self, table_index: int, k: int) -> torch.Tensor:
        """The ``k`` most frequent row ids of table ``table_index`` (cat tables first, then seq).

        Args:
            table_index: index into ``table_sizes + sequence_table_sizes``.
            k: how many rows, most frequent first.
        """
        return self._ids.hot_rows(table_index, k)

    def batch(self, step: int, rank: int, split: str = "train") -> Batch:
        """The batch of ``rank`` at ``step`` of ``split`` ("train" or "eval")."""
        return self.batch_and_logits(step, rank, split)[0]

    def true_logits(self, step: int, rank: int, split: str = "train") -> torch.Tensor:
        """The planted model's logits (float64 [B]) behind the labels of that batch."""
        return self.batch_and_logits(step, rank, split)[1]

    def batch_and_logits(self, step: int, rank: int, split: str = "train") -> tuple[Batch, torch.Tensor]:
        """The batch of (step, rank, split) and the true logits of its labels."""
        check_request(step, rank, split)
        seed = splitmix64(self.config.seed, _SPLIT_CODES[split], rank, step)
        generator = torch.Generator().manual_seed(seed)
        dense, kjt, signal = self._sample(generator, self.config.batch_size)
        logits = signal + self._bias
        clicks = torch.rand(self.config.batch_size, dtype=torch.float64, generator=generator) < torch.sigmoid(logits)
        return Batch(dense_features=dense, sparse_features=kjt, labels=clicks.to(torch.float32)), logits

    def _salts(self, purpose: int, count: int) -> torch.Tensor:
        return torch.tensor([splitmix64(self.config.seed, purpose, t) & _MASK32 for t in range(count)])

    def _sample(self, generator: torch.Generator, size: int) -> tuple[torch.Tensor, KeyedJaggedTensor, torch.Tensor]:
        """Dense features, KJT and label signal (logit without bias) of ``size`` samples."""
        config = self.config
        num_cat, num_seq = len(self.table_sizes), config.sequence_features
        if config.pooling_factor > 1.0:
            rates = torch.full((num_cat, size), config.pooling_factor - 1.0)
            extra = torch.poisson(rates, generator=generator).clamp_(max=config.bag_cap - 1)
            cat_lengths = extra.to(torch.int64) + 1
        else:
            cat_lengths = torch.ones(num_cat, size, dtype=torch.int64)
        seq_lengths = torch.randint(1, config.sequence_length + 1, (num_seq, size), generator=generator)
        lengths = torch.cat([cat_lengths, seq_lengths])
        tables = torch.repeat_interleave(torch.arange(num_cat + num_seq), lengths.sum(1))
        ids = self._ids.sample(tables, torch.rand(tables.numel(), dtype=torch.float64, generator=generator))
        weights = 1.0 - torch.rand(tables.numel(), generator=generator) if config.weighted else None
        latent = torch.randn(size, config.num_dense, generator=generator)
        counts = torch.floor(torch.exp(self._dense_log_mean + self._dense_log_std * latent))
        dense = torch.log1p(counts)
        if config.standardize_dense:
            dense = (dense - self._dense_center) / self._dense_scale
        kjt = KeyedJaggedTensor(
            keys=self._keys,
            values=ids,
            lengths=lengths.view(-1).to(torch.int32),
            weights=weights,
            stride=size,
        )
        num_cat_ids = int(cat_lengths.sum())
        cat_weights = None if weights is None else weights[:num_cat_ids].to(torch.float64)
        bags = _BagMeans(cat_lengths, cat_weights)
        cat_ids, cat_tables = ids[:num_cat_ids], tables[:num_cat_ids]
        effects = bags.mean(hashed_normal(cat_ids, self._effect_salts.index_select(0, cat_tables)))
        signal = self._effect_scale * effects.sum(0) + latent.to(torch.float64) @ self._dense_weights
        if self._pair_scale > 0:
            pair_effects = bags.mean(hashed_normal(cat_ids, self._pair_salts.index_select(0, cat_tables)))
            for a, b in config.pairs:
                signal += self._pair_scale * pair_effects[a] * pair_effects[b]
        return dense, kjt, signal

    def _calibrated_bias(self) -> float:
        """Bias b with mean(sigmoid(b + signal)) = base_ctr on a fixed calibration sample."""
        generator = torch.Generator().manual_seed(splitmix64(self.config.seed, _CALIBRATION_CODE))
        chunks = [
            self._sample(generator, _CALIBRATION_CHUNK)[2] for _ in range(_CALIBRATION_SAMPLES // _CALIBRATION_CHUNK)
        ]
        signal = torch.cat(chunks)
        lo, hi = -40.0, 40.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if torch.sigmoid(signal + mid).mean().item() < self.config.base_ctr:
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2


def log_count_moments(log_mean: torch.Tensor, log_std: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and standard deviation (float32, one per feature) of log(1 + floor(exp(m + s z))), z ~ N(0, 1):
    the normal's density integrated on a fine grid over +-9 standard deviations (no sampling, so the
    same for every seed of the batch stream)."""
    z = torch.linspace(-9.0, 9.0, 36_001, dtype=torch.float64)
    weights = torch.exp(-0.5 * z * z)
    weights /= weights.sum()
    values = torch.log1p(torch.floor(torch.exp(log_mean.double()[:, None] + log_std.double()[:, None] * z)))
    mean = values @ weights
    std = ((values - mean[:, None]) ** 2 @ weights).sqrt()
    return mean.float(), std.clamp_min(1e-6).float()


class _BagMeans:
    """Per-(table, sample) mean of per-id values, weighted by the KJT weights if any."""

    def __init__(self, lengths: torch.Tensor, weights: torch.Tensor | None) -> None:
        self._shape = lengths.shape
        self._one_hot = weights is None and bool((lengths == 1).all())
        if not self._one_hot:
            self._bag_of_id = torch.repeat_interleave(torch.arange(lengths.numel()), lengths.view(-1))
            self._weights = weights if weights is not None else torch.ones(self._bag_of_id.numel(), dtype=torch.float64)
            totals = torch.zeros(lengths.numel(), dtype=torch.float64)
            self._totals = totals.index_add_(0, self._bag_of_id, self._weights)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Bag means of ``values`` (one per id), shape [tables, samples]."""
        if self._one_hot:
            return values.view(self._shape)
        sums = torch.zeros(self._totals.numel(), dtype=torch.float64)
        sums.index_add_(0, self._bag_of_id, self._weights * values)
        return (sums / self._totals).view(self._shape)
