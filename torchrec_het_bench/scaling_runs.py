"""The scaling page's inputs: the smoke validation runs, the model's error on every run that carries
predictions, and the default preset's what-if sweep (:mod:`torchrec_het_bench.scaling` is the command)."""

import json
import statistics
import subprocess
import sys
from pathlib import Path

from torchrec.modules.embedding_configs import EmbeddingBagConfig

from torchrec_het.planner import whatif
from torchrec_het.planner.step_model import Compute
from torchrec_het.planner.whatif import tables_from_configs
from torchrec_het_bench.presets import get_preset
from torchrec_het_bench.report import network_words

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results"
SCALING_RUNS = RESULTS / "scaling"
RUN_CONFIGS = "stock_table_wise,stock_row_wise,rep_m100_s1,het_het_s10_c10,planned"
FLAT = (2, 3, 4, 8)
TWO_HOSTS = (4, 8)
SWEEP_RANKS = tuple(2**k for k in range(1, 11))
SWEEP_GBIT = (1.25, 10.0, 100.0)

# Two public reference points, with the figures their sources give.
REFERENCES = (
    {
        "name": "TorchRec DLRM, 8 GPUs over 100 Gbit/s",
        "source": "TorchRec's DLRM example (torchrec/examples/golden_training; DLRM on Criteo 1TB, 8 A100 GPUs per "
        "node, 100 Gbit/s between nodes)",
        "world_size": 8,
        "ranks_per_host": 8,
        "inter_gbit": 100.0,
        "intra_gbit": 2400.0,  # NVLink within a node, as TorchRec's planner assumes for A100 nodes
        "batch": 2048,
        "step_ms": 9.8,  # 16,384 samples a step at ~1,671,168 records/s
        "figures": {8: "~1,671,168 records/s: 9.8 ms a step"},
    },
    {
        "name": "facebookresearch/dlrm #356: 1 -> 2 nodes at 100 Gb/s",
        "source": "github.com/facebookresearch/dlrm/issues/356: sparse data dist 28 ms on one node, 246 ms on two "
        "nodes over 100 Gb/s",
        "world_size": 16,
        "ranks_per_host": 8,
        "inter_gbit": 100.0,
        "intra_gbit": 2400.0,
        "batch": 2048,  # not given by the source: the example's
        "figures": {
            8: "18 it/s (56 ms a step); sparse data dist 28 ms",
            16: "3 it/s (333 ms a step); sparse data dist 246 ms",
        },
    },
)


def run_validation(out: Path = SCALING_RUNS, python: str = sys.executable) -> None:
    """The smoke preset at 2, 3, 4 and 8 ranks on loopback, and at 4 and 8 as 2 emulated hosts."""
    jobs = [(f"flat{n}", ["--world-size", str(n)]) for n in FLAT]
    jobs += [(f"hosts{n}", ["--world-size", str(n), "--network", "emulated", "--hosts", "2"]) for n in TWO_HOSTS]
    for name, extra in jobs:
        command = [python, "-m", "torchrec_het_bench", "--preset", "smoke", "--configs", RUN_CONFIGS, "--no-progress"]
        subprocess.run([*command, *extra, "--out", str(out / name)], check=True)
        for path in (out / name).iterdir():  # the page reads results.json; the run's own report stays out of docs/
            if path.name != "results.json":
                path.unlink()


def _entries(path: Path) -> list[dict]:
    data = json.loads(path.read_text())
    return [dict(c, _run=data) for c in data["configs"] if c.get("prediction_error") and "bytes_per_step" in c]


def validation_entries() -> list[dict]:
    paths = sorted(SCALING_RUNS.glob("*/results.json")) + sorted(RESULTS.glob("*.json"))
    return [e for p in paths for e in _entries(p)]


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f}"


def _run_label(run: dict) -> str:
    return f"{run['preset']}, {run['world_size']} ranks, {network_words(run['network'])}"


def bytes_table(entries: list[dict]) -> tuple[str, float]:
    lines = [
        "| run | entry | types | measured MiB/step | predicted | error | inter-host measured / predicted |",
        "|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for e in entries:
        measured, predicted = e["bytes_per_step"]["embedding_cross_rank"], e["predicted"]["bytes_per_step"]
        error = e["prediction_error"]["embedding_cross_rank"]
        worst = max(worst, abs(error))
        inter = e.get("inter_host_embedding_bytes")
        inter_cell = f"{_mib(inter)} / {_mib(predicted['inter_host_embedding'])}" if inter else "-"
        lines.append(
            f"| {_run_label(e['_run'])} | {e['name']} | {', '.join(e['sharding_types'])} | {_mib(measured)} "
            f"| {_mib(predicted['embedding_cross_rank'])} | {error:+.1%} | {inter_cell} |"
        )
    return "\n".join(lines), worst


def step_table(entries: list[dict]) -> tuple[str, float | None, dict | None]:
    default = [e for e in entries if e["_run"]["preset"] == "default"]
    lines = [
        "| run | entry | measured ms (emb fwd / emb bwd / dense / comm wait / total) | predicted | error |",
        "|---|---|---|---|---|",
    ]
    errors = []
    for e in default:
        m, p = e["step_ms"], e["predicted"]["step_ms"]
        parts = ("emb_fwd", "emb_bwd", "dense", "comm_wait", "total")
        error = e["prediction_error"]["step_total"]
        errors.append((abs(error), e))
        lines.append(
            f"| {_run_label(e['_run'])} | {e['name']} | {' / '.join(f'{m[k]:.1f}' for k in parts)} "
            f"| {' / '.join(f'{p[k]:.1f}' for k in parts)} | {error:+.1%} |"
        )
    if not errors:
        return "No default-preset run with predictions is recorded yet.", None, None
    worst = max(errors, key=lambda x: x[0])[1]
    return "\n".join(lines), statistics.median(x for x, _ in errors), worst


def ratio_by_ranks(entries: list[dict]) -> str:
    """Measured embedding bytes of each smoke entry over stock table_wise's, by ranks."""
    by_run: dict[tuple, dict] = {}
    for e in entries:
        run = e["_run"]
        if run["preset"] != "smoke":
            continue
        key = (run["world_size"], run["network"]["mode"])
        by_run.setdefault(key, {})[e["name"]] = e["bytes_per_step"]["embedding_cross_rank"]
    names = ["stock_row_wise", "rep_m100_s1", "het_het_s10_c10", "planned"]
    lines = [
        "| ranks | network | stock table_wise MiB | " + " | ".join(names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for (ws, mode), got in sorted(by_run.items()):
        base = got.get("stock_table_wise")
        if not base:
            continue
        cells = [f"{got[n] / base:.2f}x" if n in got else "-" for n in names]
        lines.append(f"| {ws} | {mode} | {_mib(base)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def default_tables() -> list[EmbeddingBagConfig]:
    preset = get_preset("default")
    return [EmbeddingBagConfig(name=f"t{i}", embedding_dim=preset.embedding_dim, num_embeddings=rows,
                               feature_names=[f"f{i}"]) for i, rows in enumerate(preset.table_sizes)]  # fmt: skip


def sweep(compute: Compute, intra_gbit: float, ranks_per_host: int = 8) -> list[dict]:
    """The default preset's what-if at each world size and link speed between hosts."""
    preset = get_preset("default")
    shapes = tables_from_configs(default_tables(), preset.batch_size, preset.alpha)
    return whatif.sweep(shapes, preset.batch_size, compute, SWEEP_RANKS, SWEEP_GBIT, ranks_per_host, intra_gbit, 20e-6)
