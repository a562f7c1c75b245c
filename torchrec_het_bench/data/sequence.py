"""A synthetic sequence-recommendation stream: Zipf item histories, a target item and a planted label.

Every sample is a pure function of (seed, split, sample index): each random draw of
sample ``n`` comes from an integer hash of (seed, split, purpose, n, slot), not from a
generator's state, so a sample is the same whatever the batch size, world size or
order of requests. Rank ``r`` of ``W`` reads, at step ``s``, the samples
``(s * W + r) * B .. + B``: the ranks read disjoint slices of one global stream.

Keys of the KJT (all unpooled: one embedding per id):

* ``hist_item``: the user's history, ``L`` item ids drawn i.i.d. Zipf(alpha) over the
  item table (``L`` fixed at ``history_length``, or uniform in
  [``min_history_length``, ``history_length``]).
* ``hist_cat``: the category of every history item, ``cat(i)``. Each item's category is
  fixed: a Zipf(alpha) draw over the category table at a uniform hashed from the item
  id, so hot categories hold many items and category draws are skewed too.
* ``target_item``: one item id, Zipf(alpha), the candidate to score.
* ``target_cat``: the target's category.

Ground truth: item ``i`` has a hidden vector in R^k,
``z_i = sqrt(rho) g_cat(i) + sqrt(1 - rho) e_i`` (``g``, ``e`` standard normal, hashed
from (seed, id, dim), nothing stored per row; rho = ``category_share``), so items of a
category are alike. The label is Bernoulli(sigmoid(logit)) with

    logit = bias + interaction_signal * <z_target, mean_l z_hist_l - mu> / sd
                 + target_signal * effect(target),

``effect`` a hashed standard normal per item (a popularity-like main effect), ``mu``
the mean hidden vector of a history draw (Zipf draws make it large: hot items recur in
every history; without centring, <z_target, mu> would turn most of the interaction
into a per-target effect), ``sd`` the standard deviation of the centred dot product
and ``bias`` the value that makes the mean label ``base_ctr``, all three measured on a
fixed calibration sample. A model must match the target against this sample's history
to recover the interaction; the target's own embedding alone recovers only the main
effect.
"""

import math
from dataclasses import dataclass

import torch
from torchrec.datasets.utils import Batch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het_bench.data.source import check_request
from torchrec_het_bench.data.synthetic import hash32, hashed_normal
from torchrec_het_bench.data.zipf import ZipfTables, splitmix64

SEQUENCE_KEYS = ("hist_item", "hist_cat", "target_item", "target_cat")
ITEM_TABLE, CATEGORY_TABLE = "item", "category"
TABLE_FEATURES = {ITEM_TABLE: ["hist_item", "target_item"], CATEGORY_TABLE: ["hist_cat", "target_cat"]}

_SPLIT_CODES = {"train": 1, "eval": 2}
_CALIBRATION_CODE = 3
_CALIBRATION_SAMPLES = 1 << 13  # enough for the sd and bias to 1%
_MASK32 = 0xFFFFFFFF
# Salt purposes (each hashed with the seed into 32-bit salts).
_DRAW, _CATEGORY_OF, _ITEM_VEC, _CATEGORY_VEC, _EFFECT = 1, 2, 3, 4, 5


@dataclass(frozen=True)
class SequenceDataConfig:
    """Shape, skew and label signal of the synthetic sequence stream.

    Attributes:
        item_rows: rows of the item table (``hist_item``, ``target_item``).
        category_rows: rows of the category table (``hist_cat``, ``target_cat``).
        batch_size: samples per batch (per rank).
        history_length: longest history (every history has this length unless
            ``min_history_length`` is smaller).
        min_history_length: shortest history; None means ``history_length`` (fixed).
        alpha: Zipf exponent of item ids and of the item -> category map.
        seed: seed of the permutations, the planted model and the streams.
        latent_dim: width k of the hidden item vectors.
        category_share: share rho of an item's hidden vector that comes from its category.
        interaction_signal: standard deviation (logits) of the target-history term.
        target_signal: standard deviation (logits) of the target's main effect.
        base_ctr: mean label.
    """

    item_rows: int
    category_rows: int
    batch_size: int
    history_length: int = 50
    min_history_length: int | None = None
    alpha: float = 1.1
    seed: int = 0
    latent_dim: int = 8
    category_share: float = 0.5
    interaction_signal: float = 2.0
    target_signal: float = 0.5
    base_ctr: float = 0.25

    def __post_init__(self) -> None:
        for name in ("item_rows", "category_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or not 1 <= value < 2**31:
                raise ValueError(f"SequenceDataConfig.{name} must be an int in [1, 2**31), got {value!r}")
        _require(self.batch_size >= 1, "batch_size", "must be >= 1", self.batch_size)
        _require(self.history_length >= 1, "history_length", "must be >= 1", self.history_length)
        if self.min_history_length is not None:
            _require(
                1 <= self.min_history_length <= self.history_length,
                "min_history_length",
                f"must be in [1, history_length={self.history_length}]",
                self.min_history_length,
            )
        _require(math.isfinite(self.alpha) and self.alpha >= 0, "alpha", "must be finite and >= 0", self.alpha)
        _require(self.latent_dim >= 1, "latent_dim", "must be >= 1", self.latent_dim)
        _require(0.0 <= self.category_share <= 1.0, "category_share", "must be in [0, 1]", self.category_share)
        for name in ("interaction_signal", "target_signal"):
            value = getattr(self, name)
            _require(math.isfinite(value) and value >= 0, name, "must be finite and >= 0", value)
        _require(0.0 < self.base_ctr < 1.0, "base_ctr", "must be in (0, 1)", self.base_ctr)

    @property
    def shortest_history(self) -> int:
        return self.history_length if self.min_history_length is None else self.min_history_length

    @property
    def slots(self) -> int:
        """Hashed draws per sample: one per history position, the target, the length, the label."""
        return self.history_length + 3


def _require(ok: bool, field: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"SequenceDataConfig.{field} {rule}, got {value!r}")


def _salt(*parts: int) -> int:
    return splitmix64(*parts) & _MASK32


def hashed_uniform(keys: torch.Tensor, salt: int) -> torch.Tensor:
    """A uniform in (0, 1) per int64 key in [0, 2**62), a pure function of (salt, key) (float64).

    32 bits of resolution: finer than the probability of any row of a table below 2**31
    rows under Zipf(alpha <= 2) would need only for its very last rows.
    """
    h = hash32(hash32((keys & _MASK32) ^ salt) ^ (keys >> 32))
    return (h.to(torch.float64) + 0.5) / 2.0**32


def _hashed_normals(ids: torch.Tensor, salt: int, dim_salts: torch.Tensor) -> torch.Tensor:
    """Standard normals [N, len(dim_salts)] (float64), a pure function of (salt, id, dim)."""
    per_id = hash32(ids ^ salt).unsqueeze(1)
    h = hash32(per_id ^ dim_salts.unsqueeze(0))
    return torch.special.ndtri((h.to(torch.float64) + 0.5) / 2.0**32)


class SyntheticSequences:
    """Batches of the sequence stream; see the module docstring for the model.

    Args:
        config: shape, skew, signal and seed.
        world_size: ranks reading disjoint slices of each step.

    Attributes:
        feature_names: the KJT's keys, ``SEQUENCE_KEYS``.
        table_features: table name -> its features (item and category tables).
        table_rows: table name -> rows.
        num_dense: 0 (batches carry an empty ``[B, 0]`` dense tensor).
    """

    def __init__(self, config: SequenceDataConfig, world_size: int = 1) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.config = config
        self.world_size = world_size
        self.feature_names = list(SEQUENCE_KEYS)
        self.table_features = {name: list(features) for name, features in TABLE_FEATURES.items()}
        self.table_rows = {ITEM_TABLE: config.item_rows, CATEGORY_TABLE: config.category_rows}
        self.num_dense = 0
        generator = torch.Generator().manual_seed(splitmix64(config.seed, 0))
        self._zipf = ZipfTables([config.item_rows, config.category_rows], config.alpha, generator)
        seed, k = config.seed, config.latent_dim
        self._item_salt, self._category_vec_salt = _salt(seed, _ITEM_VEC), _salt(seed, _CATEGORY_VEC)
        self._dim_salts = torch.tensor([_salt(seed, _ITEM_VEC, _CATEGORY_VEC, d) for d in range(k)])
        self._category_salt = _salt(seed, _CATEGORY_OF)
        self._effect_salt = _salt(seed, _EFFECT)
        self._history_mean = torch.zeros(k, dtype=torch.float64)
        self._interaction_sd = 1.0
        self._bias = 0.0
        self._history_mean, self._interaction_sd, self._bias = self._calibrate()

    @property
    def bias(self) -> float:
        """Logit bias that makes the mean label ``config.base_ctr``."""
        return self._bias

    @property
    def interaction_sd(self) -> float:
        """Standard deviation of the centred target-history dot product on the calibration sample."""
        return self._interaction_sd

    @property
    def nbytes(self) -> int:
        """Bytes of state (the Zipf permutations and CDFs)."""
        return self._zipf.nbytes

    def hot_items(self, k: int) -> torch.Tensor:
        """The ``k`` most frequent item ids, most frequent first."""
        return self._zipf.hot_rows(0, k)

    def category_of(self, items: torch.Tensor) -> torch.Tensor:
        """The (fixed) category of every item id (int64)."""
        uniforms = hashed_uniform(items, self._category_salt)
        return self._zipf.sample(torch.ones_like(items), uniforms)

    def hidden_vectors(self, items: torch.Tensor, categories: torch.Tensor | None = None) -> torch.Tensor:
        """The planted vectors z of ``items`` (of categories ``categories`` if known), float64 [N, latent_dim]."""
        rho = self.config.category_share
        own = _hashed_normals(items, self._item_salt, self._dim_salts)
        if rho == 0.0:
            return own
        categories = self.category_of(items) if categories is None else categories
        shared = _hashed_normals(categories, self._category_vec_salt, self._dim_salts)
        return math.sqrt(rho) * shared + math.sqrt(1.0 - rho) * own

    def first_sample(self, step: int, rank: int) -> int:
        """Index (within its split) of the first sample of ``rank``'s batch at ``step``."""
        return (step * self.world_size + rank) * self.config.batch_size

    def batch(self, step: int, rank: int, split: str = "train") -> Batch:
        """The batch of ``rank`` at ``step`` of ``split`` ("train" or "eval")."""
        return self.batch_and_logits(step, rank, split)[0]

    def true_logits(self, step: int, rank: int, split: str = "train") -> torch.Tensor:
        """The planted model's logits (float64 [B]) behind the labels of that batch."""
        return self.batch_and_logits(step, rank, split)[1]

    def batch_and_logits(self, step: int, rank: int, split: str = "train") -> tuple[Batch, torch.Tensor]:
        """The batch of (step, rank, split) and the true logits of its labels."""
        check_request(step, rank, split, self.world_size)
        return self.samples(self.first_sample(step, rank), self.config.batch_size, split)

    def samples(self, first: int, count: int, split: str = "train") -> tuple[Batch, torch.Tensor]:
        """Samples ``first .. first + count - 1`` of ``split`` as one batch, and their true logits."""
        if first < 0 or count < 1:
            raise ValueError(f"need first >= 0 and count >= 1, got first={first}, count={count}")
        draw = self._draw(_SPLIT_CODES[split], first, count)
        logits = self._signal(draw) + self._bias
        labels = (draw.label_uniforms < torch.sigmoid(logits)).to(torch.float32)
        batch = Batch(dense_features=torch.empty(count, 0), sparse_features=draw.kjt, labels=labels)
        return batch, logits

    def _interaction(self, draw: "_Draw") -> torch.Tensor:
        """Raw <z_target, mean z_hist - mu> per sample."""
        return (draw.target_vectors * (draw.history_means - self._history_mean)).sum(1)

    def _signal(self, draw: "_Draw") -> torch.Tensor:
        config = self.config
        interaction = self._interaction(draw) if config.interaction_signal > 0 else 0.0
        return (config.interaction_signal / self._interaction_sd) * interaction + config.target_signal * draw.effect

    def _draw(self, split_code: int, first: int, count: int) -> "_Draw":
        """Everything random about samples first..first+count-1 of a split."""
        config = self.config
        salt = _salt(config.seed, _DRAW, split_code)
        slots = config.slots
        base = (torch.arange(count, dtype=torch.int64) + first) * slots
        longest, shortest = config.history_length, config.shortest_history
        if shortest == longest:
            lengths = torch.full((count,), longest, dtype=torch.int64)
        else:
            spread = longest - shortest + 1
            lengths = shortest + (hashed_uniform(base + longest + 1, salt) * spread).to(torch.int64).clamp_(
                max=spread - 1
            )
        sample_of = torch.repeat_interleave(torch.arange(count), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        position = torch.arange(sample_of.numel()) - starts.index_select(0, sample_of)
        history_keys = base.index_select(0, sample_of) + position
        items = self._zipf.sample(torch.zeros_like(history_keys), hashed_uniform(history_keys, salt))
        target = self._zipf.sample(torch.zeros(count, dtype=torch.int64), hashed_uniform(base + longest, salt))
        label_uniforms = hashed_uniform(base + longest + 2, salt)
        # Zipf draws repeat: hash every distinct item once.
        distinct, inverse = torch.unique(torch.cat([items, target]), return_inverse=True)
        distinct_categories = self.category_of(distinct)
        categories = distinct_categories.index_select(0, inverse)
        num_items = items.numel()
        kjt = KeyedJaggedTensor(
            keys=self.feature_names,
            values=torch.cat([items, categories[:num_items], target, categories[num_items:]]),
            lengths=torch.cat([lengths, lengths, torch.ones(2 * count, dtype=torch.int64)]).to(torch.int32),
            stride=count,
        )
        vectors = self.hidden_vectors(distinct, distinct_categories)
        history = torch.zeros(count, config.latent_dim, dtype=torch.float64)
        history.index_add_(0, sample_of, vectors.index_select(0, inverse[:num_items]))
        history /= lengths.unsqueeze(1).to(torch.float64)
        effect = hashed_normal(target, torch.full_like(target, self._effect_salt))
        return _Draw(kjt, lengths, history, vectors.index_select(0, inverse[num_items:]), effect, label_uniforms)

    def _calibrate(self) -> tuple[torch.Tensor, float, float]:
        """(mu, sd of the centred dot product, bias for base_ctr) on a fixed calibration sample."""
        draw = self._draw(_CALIBRATION_CODE, 0, _CALIBRATION_SAMPLES)
        weights = draw.lengths.to(torch.float64).unsqueeze(1)
        self._history_mean = (draw.history_means * weights).sum(0) / weights.sum()  # mean z over all draws
        self._interaction_sd = float(self._interaction(draw).std().clamp_min(1e-12))
        signal = self._signal(draw)
        lo, hi = -40.0, 40.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if torch.sigmoid(signal + mid).mean().item() < self.config.base_ctr:
                lo = mid
            else:
                hi = mid
        return self._history_mean, self._interaction_sd, (lo + hi) / 2


@dataclass(frozen=True)
class _Draw:
    kjt: KeyedJaggedTensor
    lengths: torch.Tensor  # history lengths [B]
    history_means: torch.Tensor  # mean z of each history, float64 [B, k]
    target_vectors: torch.Tensor  # z of each target, float64 [B, k]
    effect: torch.Tensor  # target main effect, float64 [B]
    label_uniforms: torch.Tensor  # float64 [B]
