"""torchx components of torchrec_het.

Run from the repository root with the virtual environment's bin on PATH
(torchx starts ``torchrun`` from PATH):

    torchx run -s local_cwd recipes/components.py:bench --preset smoke
"""

import torchx.specs as specs
from torchx.components.dist import ddp


def bench(
    preset: str = "smoke",
    configs: str = "",
    out: str = "bench_out",
    j: str = "1x2",
    cpu: int = 2,
    memMB: int = 8192,
    max_retries: int = 0,
) -> specs.AppDef:
    """Runs the DLRM benchmark (stock TorchRec and torchrec_het configurations) with torchrun.

    Args:
        preset: benchmark preset: smoke, default or full
        configs: comma-separated configuration names; empty runs the stock ones that apply
        out: directory for results.json, results.md and results.png
        j: {nnodes}x{nproc_per_node}, e.g. 1x2 for two ranks on one host
        cpu: CPUs per replica
        memMB: memory per replica, MiB
        max_retries: restarts of the job on failure
    """
    return ddp(
        "--preset",
        preset,
        "--configs",
        configs,
        "--out",
        out,
        "--no-progress",
        m="torchrec_het.bench",
        name="torchrec_het_bench",
        j=j,
        cpu=cpu,
        memMB=memMB,
        max_retries=max_retries,
    )
