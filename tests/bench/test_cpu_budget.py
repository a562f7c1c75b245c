"""One CPU budget: ranks on this machine x intra-op threads <= its cores, emulated hosts' ranks included."""

from __future__ import annotations

import json

import pytest

from torchrec_het.integration.cpu_budget import CpuBudget, budget_for, machine_cores
from torchrec_het_bench import adoption, launch
from torchrec_het_bench.adoption_runs import Case
from torchrec_het_bench.netem import NetworkEmulationUnavailable, check_available
from torchrec_het_bench.presets import get_preset
from torchrec_het_bench.testing.netem_ranks import budget_rank, write_budget
from torchrec_het_bench.worker import RunSpec


def _emulation_unavailable() -> str | None:
    try:
        check_available()
    except NetworkEmulationUnavailable as error:
        return str(error)
    return None


def test_budget_shares_the_cores() -> None:
    assert budget_for(2, cores=2) == CpuBudget(2, 2, 1)
    assert budget_for(1, cores=4).threads_per_rank == 4
    assert budget_for(3, cores=8).threads_per_rank == 2
    assert not budget_for(2, cores=2).oversubscribed and budget_for(2, cores=2).warning() is None
    over = budget_for(3, cores=2)  # more ranks than cores: one thread each, still oversubscribed
    assert over.threads_per_rank == 1 and over.oversubscribed
    assert "3 ranks x 1 threads on 2 cores" in over.warning()
    assert over.env() == {"OMP_NUM_THREADS": "1", "TORCHREC_HET_RANKS_ON_MACHINE": "3"}
    with pytest.raises(ValueError, match="cores, ranks and threads"):
        CpuBudget(2, 0, 1)


def test_stated_ranks_are_checked(monkeypatch) -> None:
    from torchrec_het.integration.cpu_budget import ranks_on_machine

    monkeypatch.setenv("TORCHREC_HET_RANKS_ON_MACHINE", "zero")
    with pytest.raises(ValueError, match="TORCHREC_HET_RANKS_ON_MACHINE"):
        ranks_on_machine()
    monkeypatch.setenv("TORCHREC_HET_RANKS_ON_MACHINE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert ranks_on_machine() == 4  # emulated hosts: one rank per node, four on the machine
    monkeypatch.delenv("TORCHREC_HET_RANKS_ON_MACHINE")
    assert ranks_on_machine() == 1


def _emulated_spec(tmp_path, hosts: int = 2) -> RunSpec:
    network = {"mode": "emulated", "hosts": hosts, "gbit": 10.0, "delay_ms": 0.0}
    return RunSpec(get_preset("smoke"), ("stock_table_wise",), hosts, tuple(range(hosts)), network,
                   out_dir=str(tmp_path))  # fmt: skip


def test_spawned_emulated_hosts_count_every_rank(tmp_path) -> None:
    spec = launch.with_cpu_budget(_emulated_spec(tmp_path))
    assert spec.local_world_size == 1  # one rank per emulated host ...
    assert spec.cpu.ranks_on_machine == 2  # ... but both on this machine's cores
    assert spec.cpu.ranks_on_machine * spec.cpu.threads_per_rank <= max(machine_cores(), 2)


def test_both_adoption_arms_keep_the_budget_on_emulated_hosts() -> None:
    for arm in ("stock", "launcher"):
        env = adoption.run_env(arm, Case("zipf", 1.1, False), None, False, [], ranks=2)
        assert int(env["OMP_NUM_THREADS"]) * 2 <= max(machine_cores(), 2), (arm, env["OMP_NUM_THREADS"])
        assert env["TORCHREC_HET_RANKS_ON_MACHINE"] == "2"


@pytest.mark.skipif(_emulation_unavailable() is not None, reason=f"network emulation: {_emulation_unavailable()}")
def test_the_emulated_path_does_not_oversubscribe(tmp_path) -> None:
    """The benchmark's own spawn onto 2 emulated hosts: every rank's intra-op threads, summed, fit the cores."""
    launch.spawn(_emulated_spec(tmp_path), write_budget, body=budget_rank)
    found = json.loads((tmp_path / "budget.json").read_text())
    cores = machine_cores()
    assert sum(found["threads"]) <= max(cores, len(found["threads"])), found
    assert found["budget"]["ranks_on_machine"] == 2 and not found["budget"]["oversubscribed"] or cores < 2
