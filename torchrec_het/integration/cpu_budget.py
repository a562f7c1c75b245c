"""One CPU budget for every rank on a machine: ranks here × intra-op threads ≤ the machine's cores.

Ranks of emulated hosts (network namespaces on one machine) share the machine's cores, so
"ranks on this machine" counts all of them, not torchrun's ranks per node. Whoever starts
several ranks on one machine states how many (``TORCHREC_HET_RANKS_ON_MACHINE``, which
:meth:`CpuBudget.env` sets with ``OMP_NUM_THREADS`` for child processes); a real multi-host
launch keeps torchrun's rule (``OMP_NUM_THREADS=1`` with several workers per node).

Why: with 2 ranks of 2 threads on 2 cores, the same pair of configurations measured 1.0-1.09x
in one company and 1.32x in another (docs/measuring.md#cpu-budget).
"""

import os
from dataclasses import asdict, dataclass

import torch

ENV_RANKS_ON_MACHINE = "TORCHREC_HET_RANKS_ON_MACHINE"  # read and checked in env_settings, with the others


def machine_cores() -> int:
    """Cores this process may run on (its CPU affinity; ``os.cpu_count()`` where that is unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class CpuBudget:
    """How a machine's cores are shared by the ranks it runs.

    Attributes:
        cores: the machine's cores (this process's affinity).
        ranks_on_machine: ranks running on these cores at once (every emulated host's included).
        threads_per_rank: torch intra-op threads of each rank.
    """

    cores: int
    ranks_on_machine: int
    threads_per_rank: int

    def __post_init__(self) -> None:
        if min(self.cores, self.ranks_on_machine, self.threads_per_rank) < 1:
            raise ValueError(f"a CPU budget needs cores, ranks and threads >= 1, got {self}")

    @property
    def oversubscribed(self) -> bool:
        return self.ranks_on_machine * self.threads_per_rank > self.cores

    def warning(self) -> str | None:
        """One line when the ranks' threads exceed the cores, else None."""
        if not self.oversubscribed:
            return None
        return (
            f"oversubscribed: {self.ranks_on_machine} ranks x {self.threads_per_rank} threads on {self.cores} cores; "
            "speeds will depend on what else runs (set OMP_NUM_THREADS or run fewer ranks per machine)"
        )

    def describe(self) -> str:
        return f"{self.ranks_on_machine} ranks x {self.threads_per_rank} thread(s) on {self.cores} cores"

    def as_dict(self) -> dict:
        return dict(asdict(self), oversubscribed=self.oversubscribed)

    def env(self) -> dict[str, str]:
        """The variables a child rank process needs to keep to this budget."""
        return {"OMP_NUM_THREADS": str(self.threads_per_rank), ENV_RANKS_ON_MACHINE: str(self.ranks_on_machine)}


def budget_for(ranks_on_machine: int, cores: int | None = None) -> CpuBudget:
    """The fair budget: each of ``ranks_on_machine`` ranks gets ``cores // ranks`` threads (at least 1;
    more ranks than cores stay oversubscribed, which :meth:`CpuBudget.warning` says)."""
    cores = machine_cores() if cores is None else cores
    return CpuBudget(cores, ranks_on_machine, max(1, cores // max(1, ranks_on_machine)))


def stated_ranks_on_machine() -> int | None:
    """``$TORCHREC_HET_RANKS_ON_MACHINE`` (an int >= 1), or None when unset.

    Raises:
        ValueError: naming the variable.
    """
    from torchrec_het.integration.env_settings import SETTING_OF, env_value

    return env_value(SETTING_OF["ranks_on_machine"])


def ranks_on_machine(default: int = 1) -> int:
    """Ranks sharing this machine: as stated (``$TORCHREC_HET_RANKS_ON_MACHINE``), else torchrun's
    ``$LOCAL_WORLD_SIZE``, else ``default``."""
    stated = stated_ranks_on_machine()
    if stated is not None:
        return stated
    local = os.environ.get("LOCAL_WORLD_SIZE", "").strip()
    return int(local) if local.isdigit() and int(local) >= 1 else default


def apply_budget(budget: CpuBudget) -> CpuBudget:
    """Gives this rank its threads (``torch.set_num_threads``); returns ``budget``."""
    torch.set_num_threads(budget.threads_per_rank)
    return budget


def current_budget(default_ranks: int = 1) -> CpuBudget:
    """The budget this process runs under now: its threads, the ranks :func:`ranks_on_machine` counts."""
    return CpuBudget(machine_cores(), ranks_on_machine(default_ranks), torch.get_num_threads())
