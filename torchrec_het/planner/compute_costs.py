"""The plugin lookups' compute cost per id, stored with the package (``compute_costs.json``).

The table holds, for each plugin type and setting class (``exact``: cache bounds s = 0,
replicas synced every step; ``stale``: any bound or sync interval above that), the seconds
per id per step one rank spends beyond a stock TBE lookup of the same ids (forward, backward
and fused optimizer), as measured by the microbenchmark (:mod:`torchrec_het_bench.micro`)
against stock ``table_wise``: of the stock types, its step carries the least communication
(row_wise's carries a reduce-scatter of every pooled bag, which the planner prices as
communication, not compute). The estimator adds the figure to the option's row_wise twin's
compute (TorchRec prices a TBE lookup alike under both). A figure may be negative.
Regenerate it with ``python -m torchrec_het_bench.calibrate <micro.json>``.

Version 2: figures against table_wise (version 1's were against row_wise).
"""

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from torchrec_het.types import HET_CACHED_ROW_WISE, HET_ROW_REPLICATED

VERSION = 2
COSTS_PATH = Path(__file__).with_name("compute_costs.json")
ENV_COSTS = "TORCHREC_HET_COMPUTE_COSTS"  # a table measured on your machines (see :func:`default_compute_costs`)
SETTING_CLASSES = ("exact", "stale")
CALIBRATED_TYPES = (HET_CACHED_ROW_WISE, HET_ROW_REPLICATED)


def setting_class(
    sharding_type: str, sync_every: int = 1, s_read: int = 0, s_write: int = 0, rows: bool = False
) -> str:
    """ "exact" (replicas synced every step; cache bounds 0) or "stale", as the table keys the figures;
    ``het_row_replicated`` bags whose cold ids fetch rows (``rows``): "rows" (where the table has
    that figure; else its setting class)."""
    if sharding_type == HET_ROW_REPLICATED:
        if rows:
            return "rows"
        return "exact" if sync_every <= 1 else "stale"
    return "exact" if s_read == 0 and s_write == 0 else "stale"


@dataclass(frozen=True)
class ComputeCosts:
    """Extra compute per id per step of each plugin type, beyond a stock TBE lookup (added to its row_wise twin's).

    Attributes:
        extra_seconds_per_id: plugin type -> setting class ("exact" / "stale") -> seconds.
        device: the device kind the figures were measured on ("cpu").
        source: the file they were read from (named in errors), if any.
        reference_seconds_per_id: the reference (stock table_wise) step's seconds per id, as
            measured beside the figures (the what-if's default lookup cost), if recorded.
    """

    extra_seconds_per_id: dict[str, dict[str, float]]
    device: str = "cpu"
    source: str | None = None
    reference_seconds_per_id: float | None = None  # stock table_wise's own step per id, where measured

    @classmethod
    def bytes_only(cls) -> "ComputeCosts":
        """No extra compute for any type: the plugin's options priced by their bytes alone."""
        return cls({t: dict.fromkeys(SETTING_CLASSES, 0.0) for t in CALIBRATED_TYPES}, device="any")

    def applies_to(self, compute_device: str) -> bool:
        """Whether the figures hold on ``compute_device`` (measured there, or zero everywhere)."""
        return self.device in ("any", compute_device)

    def extras_on(self, compute_device: str) -> dict:
        """The extra seconds per id by type and setting class, where they hold on ``compute_device`` (else none)."""
        return self.extra_seconds_per_id if self.applies_to(compute_device) else {}

    def per_id(self, sharding_type: str, setting_class: str) -> float:
        """Extra seconds per id per step of ``sharding_type`` under ``setting_class``."""
        return self.extra_seconds_per_id[sharding_type][setting_class]


def load_compute_costs(path: str | Path | None = None) -> ComputeCosts:
    """Reads a compute-cost table (default: the one shipped with the package).

    Raises:
        ValueError: the file is missing, unreadable, of another version, or lacks a field;
            the message names the file.
    """
    path = Path(path) if path is not None else COSTS_PATH
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"compute-cost table {str(path)!r} cannot be read: {error}") from error
    if not isinstance(doc, dict) or "version" not in doc:
        raise ValueError(f"compute-cost table {str(path)!r} has no 'version' field (expected {VERSION})")
    if doc["version"] != VERSION:
        raise ValueError(
            f"compute-cost table {str(path)!r} has version {doc['version']!r}, this torchrec_het reads version "
            f"{VERSION}; regenerate it with python -m torchrec_het_bench.calibrate <micro.json>"
        )
    for key in ("device", "measured_with", "measured_on", "extra_seconds_per_id"):
        if key not in doc:
            raise ValueError(f"compute-cost table {str(path)!r} lacks the field {key!r}")
    costs = doc["extra_seconds_per_id"]
    for sharding_type in CALIBRATED_TYPES:
        for setting_class in SETTING_CLASSES:
            value = (costs.get(sharding_type) or {}).get(setting_class) if isinstance(costs, dict) else None
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(
                    f"compute-cost table {str(path)!r}: extra_seconds_per_id[{sharding_type!r}][{setting_class!r}] "
                    f"must be a finite number, got {value!r}"
                )
    reference = doc.get("reference_seconds_per_id")
    figures = {t: {c: float(costs[t][c]) for c in SETTING_CLASSES} for t in CALIBRATED_TYPES}
    rows = costs[HET_ROW_REPLICATED].get("rows")  # optional: fetched cold rows (else priced as "exact")
    figures[HET_ROW_REPLICATED]["rows"] = (
        float(rows) if isinstance(rows, (int, float)) else figures[HET_ROW_REPLICATED]["exact"]
    )
    return ComputeCosts(
        figures,
        str(doc["device"]),
        str(path),
        float(reference) if isinstance(reference, (int, float)) else None,
    )


_loaded: dict[str, ComputeCosts] = {}


def default_compute_costs() -> ComputeCosts:
    """The table the planner prices with: ``$TORCHREC_HET_COMPUTE_COSTS`` when set (a table from
    ``python -m torchrec_het_bench.calibrate``, measured where you train), else the one shipped
    with the package (read once per path)."""
    path = os.environ.get(ENV_COSTS) or str(COSTS_PATH)
    if path not in _loaded:
        _loaded[path] = load_compute_costs(path)
    return _loaded[path]


def save_bytes_only_table(path: str | Path, why: str) -> Path:
    """Writes a table in which no plugin lookup costs more than a stock one (the plan then follows
    the bytes alone), e.g. for a machine where they were measured to be on par; ``why`` is
    recorded as how it was obtained."""
    doc = {
        "version": VERSION,
        "device": "any",
        "measured_with": why,
        "measured_on": "-",
        "extra_seconds_per_id": {t: dict.fromkeys(SETTING_CLASSES, 0.0) for t in CALIBRATED_TYPES},
    }
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")
    return Path(path)
