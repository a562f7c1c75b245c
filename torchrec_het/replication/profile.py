"""Per-table row access counts from a sample of the training stream (FAE's profile), saved through iopath.

A profile says how often each row of each table was read in the sampled batches.
It is the input of hot-set and tier selection, and can warm a cache. Files are a
``torch.save`` of plain tensors and lists, with a format name and version, written
and read through iopath's global ``g_pathmgr`` (local paths, or any scheme whose
handler is registered with it, e.g. ``g_pathmgr.register_handler(...)``).
"""

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from iopath.common.file_io import g_pathmgr
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.errors import ProfileNotFoundError

FORMAT = "torchrec_het.profile"
VERSION = 1


@dataclass(frozen=True)
class AccessProfile:
    """Row access counts per table.

    Attributes:
        tables: table names.
        num_rows: rows of each table.
        counts: per table, int64 ``[num_rows]`` reads of each row in the sampled batches.
        batches: batches counted.
    """

    tables: tuple[str, ...]
    num_rows: tuple[int, ...]
    counts: tuple[torch.Tensor, ...]
    batches: int

    def __post_init__(self) -> None:
        if not (len(self.tables) == len(self.num_rows) == len(self.counts)):
            raise ValueError("tables, num_rows and counts must have one entry per table")
        for name, rows, counts in zip(self.tables, self.num_rows, self.counts):
            if counts.shape != (rows,) or counts.dtype != torch.int64:
                raise ValueError(
                    f"table {name!r}: counts must be int64 [{rows}], got {counts.dtype} {list(counts.shape)}"
                )

    def fingerprint(self) -> str:
        """A short hash of the tables, row counts, counts and batches: names this profile in a plan."""
        digest = hashlib.blake2b(digest_size=8)
        digest.update(repr((self.tables, self.num_rows, self.batches)).encode())
        for counts in self.counts:
            digest.update(counts.contiguous().numpy().tobytes())
        return digest.hexdigest()

    def table_counts(self, name: str) -> torch.Tensor:
        """The counts of table ``name``."""
        if name not in self.tables:
            raise KeyError(f"table {name!r} is not in the profile; it has {list(self.tables)}")
        return self.counts[self.tables.index(name)]

    def hottest(self, name: str, k: int) -> torch.Tensor:
        """The ``k`` most read rows of table ``name``, hottest first (ties: lower id first)."""
        counts = self.table_counts(name)
        order = torch.sort(counts, descending=True, stable=True).indices
        return order[: min(k, counts.numel())]

    def coverage(self, name: str, k: int) -> float:
        """Share of the table's sampled reads that its ``k`` hottest rows take."""
        counts = self.table_counts(name)
        total = int(counts.sum())
        return float(counts[self.hottest(name, k)].sum()) / total if total else 0.0


class AccessProfiler:
    """Counts row reads of your own batches, one at a time, into an :class:`AccessProfile`.

    Feed it one rank's batches (the profile means reads per batch of one rank), every one or a
    sample, then save it for the planner and the sharders::

        profiler = AccessProfiler.for_model(model)   # or AccessProfiler(ebc.embedding_bag_configs())
        for step, batch in enumerate(itertools.islice(dataloader, 400)):
            if step % 20 == 0:
                profiler.observe(batch.sparse_features)
        profiler.save("profile.pt")

    Args:
        tables: the model's table configs (``EmbeddingBagConfig`` or ``EmbeddingConfig``).
    """

    def __init__(self, tables: list[BaseEmbeddingConfig]) -> None:
        if not tables:
            raise ValueError("AccessProfiler needs at least one table config")
        self.tables = list(tables)
        self.counts = [torch.zeros(t.num_embeddings, dtype=torch.int64) for t in self.tables]
        self.batches = 0

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> "AccessProfiler":
        """A profiler of every table of ``model``'s EmbeddingBagCollections and EmbeddingCollections."""
        tables = []
        for module in model.modules():
            for getter in ("embedding_bag_configs", "embedding_configs"):
                if hasattr(module, getter):
                    tables += list(getattr(module, getter)())
        return cls(tables)

    def observe(self, features: KeyedJaggedTensor) -> None:
        """Adds one batch's reads.

        Raises:
            ValueError: the batch lacks one of the tables' features, or holds an id outside its
                table (the message names the feature).
        """
        present = set(features.keys())
        for config, table_counts in zip(self.tables, self.counts):
            for feature in config.feature_names:
                if feature not in present:
                    raise ValueError(
                        f"feature {feature!r} of table {config.name!r} is missing from batch {self.batches}"
                    )
                ids = features[feature].values().long()
                if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= config.num_embeddings):
                    raise ValueError(
                        f"feature {feature!r}: ids outside table {config.name!r}'s rows [0, {config.num_embeddings})"
                    )
                table_counts += torch.bincount(ids, minlength=config.num_embeddings)
        self.batches += 1

    def profile(self) -> AccessProfile:
        """The counts so far (copies)."""
        return AccessProfile(
            tuple(t.name for t in self.tables),
            tuple(t.num_embeddings for t in self.tables),
            tuple(c.clone() for c in self.counts),
            self.batches,
        )

    def save(self, path: str) -> AccessProfile:
        """Writes the profile to ``path`` (any iopath path) and returns it.

        Raises:
            ValueError: no batch was observed (an empty profile would let the planner price nothing).
        """
        if not self.batches:
            raise ValueError(f"{path}: no batch observed; call observe() on at least one batch before save()")
        profile = self.profile()
        save_profile(profile, path)
        return profile


def count_accesses(
    batches: Iterable[KeyedJaggedTensor], tables: list[BaseEmbeddingConfig], every: int = 1
) -> AccessProfile:
    """Counts row reads per table over every ``every``-th batch of ``batches`` (``every=20`` samples 5%).

    Raises:
        ValueError: a sampled batch lacks one of the tables' features, or holds an id
            outside its table (the message names the feature).
    """
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    profiler = AccessProfiler(tables)
    for index, kjt in enumerate(batches):
        if index % every == 0:
            profiler.observe(kjt)
    return profiler.profile()


def save_profile(profile: AccessProfile, path: str) -> None:
    """Writes ``profile`` to ``path`` (any iopath path)."""
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "tables": list(profile.tables),
        "num_rows": list(profile.num_rows),
        "counts": list(profile.counts),
        "batches": profile.batches,
    }
    with g_pathmgr.open(path, "wb") as f:
        torch.save(payload, f)


def load_profile(path: str, tables: list[EmbeddingBagConfig] | None = None) -> AccessProfile:
    """Reads a profile; with ``tables``, checks that it describes exactly those tables.

    Raises:
        ProfileNotFoundError: no file at ``path`` (a ``ConfigurationError`` and a ``FileNotFoundError``;
            the message says how to make a profile).
        ValueError: the file is not a profile, is corrupt, has another format version,
            or does not match ``tables`` (the message names the table).
    """
    try:
        with g_pathmgr.open(path, "rb") as f:
            payload = torch.load(f, weights_only=True)
    except FileNotFoundError:
        raise ProfileNotFoundError(
            f"{path}: no access profile there; make one with torchrec_het.replication.AccessProfiler on a sample "
            "of your batches (observe(features), then save(path)), or for the recipe's data with "
            f"python -m torchrec_het_bench.profile --preset smoke --out {path}"
        ) from None
    except Exception as error:  # truncated or foreign files fail in many ways inside torch.load
        raise ValueError(f"{path}: not a readable torchrec_het profile ({type(error).__name__}: {error})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path}: not a torchrec_het profile")
    if payload.get("version") != VERSION:
        raise ValueError(f"{path}: profile format version {payload.get('version')}, this code reads {VERSION}")
    try:
        profile = AccessProfile(
            tuple(payload["tables"]), tuple(payload["num_rows"]), tuple(payload["counts"]), int(payload["batches"])
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: corrupt profile ({error})") from None
    if tables is not None:
        _check_matches(profile, tables, path)
    return profile


def _check_matches(profile: AccessProfile, tables: list[EmbeddingBagConfig], path: str) -> None:
    expected = {t.name: t.num_embeddings for t in tables}
    found = dict(zip(profile.tables, profile.num_rows))
    for name, rows in expected.items():
        if name not in found:
            raise ValueError(f"{path}: profile has no table {name!r} (it has {sorted(found)})")
        if found[name] != rows:
            raise ValueError(f"{path}: table {name!r} has {found[name]} rows in the profile but {rows} in the model")
    extra = sorted(set(found) - set(expected))
    if extra:
        raise ValueError(f"{path}: profile has table(s) {extra} that the model does not have")
