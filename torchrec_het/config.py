"""Frozen configuration of the HET cache: one global setting, optional per-table overrides."""

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from torchrec_het.cache import POLICIES

PROTOCOLS = ("het", "lease")


@dataclass(frozen=True)
class CacheSettings:
    """How one table's remote rows are cached on every rank.

    Attributes:
        s_read: read bound. ``het``: a cached row is served while the owner's
            version is at most ``s_read`` updates ahead of the cached copy (every
            read still sends id and version). ``lease``: a row fetched or
            validated at step t is served without asking until step t + s_read.
        s_write: write bound: a cached row's local gradients are held back until
            more than ``s_write`` of them are pending (then pushed to the owner).
        capacity: rows cached per rank: an int is a row count, a float in
            [0, 1] a fraction of the table's rows.
        policy: eviction policy, ``lru`` or ``lfu``.
        protocol: ``het`` (version check on every read) or ``lease``.
    """

    s_read: int = 0
    s_write: int = 0
    capacity: int | float = 0.1
    policy: str = "lru"
    protocol: str = "het"

    def __post_init__(self) -> None:
        if self.s_read < 0 or self.s_write < 0:
            raise ValueError(f"s_read and s_write must be >= 0, got {self.s_read} and {self.s_write}")
        if isinstance(self.capacity, bool) or not isinstance(self.capacity, (int, float)):
            raise TypeError(f"capacity must be an int (rows) or a float (fraction), got {self.capacity!r}")
        if isinstance(self.capacity, float) and not 0.0 <= self.capacity <= 1.0:
            raise ValueError(f"a fractional capacity must be in [0, 1], got {self.capacity}")
        if isinstance(self.capacity, int) and self.capacity < 0:
            raise ValueError(f"capacity must be >= 0 rows, got {self.capacity}")
        if self.policy not in POLICIES:
            raise ValueError(f"unknown eviction policy {self.policy!r}; choose from {POLICIES}")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"unknown protocol {self.protocol!r}; choose from {PROTOCOLS}")

    @property
    def exact(self) -> bool:
        """Both bounds 0: every read sees every update, so a copy this rank wrote is fetched again
        before it is read (such a cache holds no rows)."""
        return self.s_read == 0 and self.s_write == 0

    def capacity_rows(self, num_rows: int) -> int:
        """The capacity in rows for a table of ``num_rows`` rows."""
        if isinstance(self.capacity, float):
            return int(self.capacity * num_rows)
        return min(self.capacity, num_rows)


@dataclass(frozen=True)
class HetCacheConfig:
    """The cache of every ``het_cached_row_wise`` table: ``default``, unless ``per_table`` names it.

    Attributes:
        default: settings of tables not named in ``per_table``.
        per_table: table name -> its own settings (kept as a read-only view of a copy).
    """

    default: CacheSettings = field(default_factory=CacheSettings)
    per_table: Mapping[str, CacheSettings] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, settings in self.per_table.items():
            if not isinstance(settings, CacheSettings):
                raise TypeError(f"per_table[{name!r}] must be CacheSettings, got {type(settings).__name__}")
        object.__setattr__(self, "per_table", MappingProxyType(dict(self.per_table)))

    def __reduce__(self) -> tuple:
        """Pickles through the constructor: a mappingproxy does not pickle, a dict does (and is re-wrapped)."""
        return type(self), (self.default, dict(self.per_table))

    def for_table(self, name: str) -> CacheSettings:
        """The settings of table ``name``."""
        return self.per_table.get(name, self.default)

    def check_tables(self, table_names: list[str]) -> None:
        """Raises ValueError if ``per_table`` names a table that is not in ``table_names``."""
        unknown = sorted(set(self.per_table) - set(table_names))
        if unknown:
            raise ValueError(f"cache settings name unknown table(s) {unknown}; tables are {sorted(table_names)}")

    def with_default(self, **changes: object) -> "HetCacheConfig":
        """A copy whose default settings have ``changes`` applied."""
        return replace(self, default=replace(self.default, **changes))
