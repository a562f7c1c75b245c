"""The process group timeout as a setting: ``TORCHREC_HET_PG_TIMEOUT`` / ``install(pg_timeout=)``
reaches the script's ``init_process_group`` calls that give no timeout, the plugin's own groups
take their parent's, and the recipe has ``--pg-timeout``."""

import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d

import torchrec_het
from torchrec_het.integration.env_settings import ENV_PG_TIMEOUT, check_environment, env_settings
from torchrec_het_bench.recipes import train_dlrm


@pytest.mark.parametrize("value", ["0", "-3", "soon", "inf", "nan"])
def test_a_bad_timeout_names_the_variable(monkeypatch, value: str) -> None:
    monkeypatch.setenv(ENV_PG_TIMEOUT, value)
    with pytest.raises(ValueError, match=rf"^{ENV_PG_TIMEOUT} must be a number of seconds > 0, got '{value}'$"):
        check_environment()  # what the launcher runs before any worker
    with pytest.raises(ValueError, match=ENV_PG_TIMEOUT):
        torchrec_het.install()
    assert not torchrec_het.integration.registration.installed()


def test_the_timeout_is_read_in_seconds(monkeypatch) -> None:
    monkeypatch.setenv(ENV_PG_TIMEOUT, " 2.5 ")
    assert env_settings()["pg_timeout"] == timedelta(seconds=2.5)
    monkeypatch.delenv(ENV_PG_TIMEOUT)
    assert env_settings()["pg_timeout"] is None


@pytest.mark.parametrize("value", [0, -1.0, True, "5", timedelta(0)])
def test_a_bad_install_argument_is_refused(value) -> None:
    with pytest.raises(ValueError, match="pg_timeout must be a number of seconds > 0"):
        torchrec_het.install(pg_timeout=value)
    assert not torchrec_het.integration.registration.installed()


def test_install_wraps_init_process_group_in_both_homes_and_uninstall_restores_it(monkeypatch) -> None:
    stock = dist.init_process_group
    assert distributed_c10d.init_process_group is stock
    monkeypatch.delenv(ENV_PG_TIMEOUT, raising=False)
    try:
        torchrec_het.install()
        assert dist.init_process_group is stock, "no timeout set: nothing to replace"
        torchrec_het.install(pg_timeout=7)
        assert dist.init_process_group is not stock and distributed_c10d.init_process_group is dist.init_process_group
    finally:
        torchrec_het.uninstall()
    assert dist.init_process_group is stock and distributed_c10d.init_process_group is stock


GROUPS = """
import os, sys
from datetime import timedelta
import torch.distributed as dist
import torchrec_het
from torchrec_het._compat import process_group_timeout

torchrec_het.install(pg_timeout=7)
store = "file://" + sys.argv[1]
if sys.argv[2] == "own":
    dist.init_process_group("gloo", store, timedelta(seconds=11), rank=0, world_size=1)
else:
    dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
sub = dist.new_group([0], timeout=process_group_timeout(None))  # as the plugin's groups are made
print(process_group_timeout(None).total_seconds(), process_group_timeout(sub).total_seconds())
dist.destroy_process_group()
"""


@pytest.mark.parametrize("given, expected", [("none", "7.0 7.0"), ("own", "11.0 11.0")])
def test_the_timeout_reaches_groups_that_give_none_and_the_plugins_subgroups(
    tmp_path, given: str, expected: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(GROUPS), str(tmp_path / "store"), given],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == expected


def test_the_recipe_takes_a_timeout_in_seconds() -> None:
    assert train_dlrm.parse_args(["--pg-timeout", "12.5"]).pg_timeout == 12.5
    assert train_dlrm.parse_args([]).pg_timeout is None
    with pytest.raises(SystemExit):
        train_dlrm.parse_args(["--pg-timeout", "0"])
