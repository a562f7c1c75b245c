"""``python -m torchrec_het.launch``: command-line parsing, the torchrun command it builds,
and worker mode running a script with the plugin installed (one short process)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from torchrec_het.launch import parse_command, torchrun_argv

REPO = Path(__file__).resolve().parents[2]

WORKER_SCRIPT = """
import sys
from torchrec.distributed.model_parallel import get_default_sharders
import torchrec_het.integration.registration
print("argv", sys.argv[1:])
print("name", __name__)
print("installed", torchrec_het.integration.registration.installed())
print("sharders", sorted(type(sharder).__name__ for sharder in get_default_sharders()))
"""


def test_parse_splits_at_the_script_like_python() -> None:
    command = parse_command(["--nproc-per-node", "2", "--max_restarts=1", "train.py", "--steps", "3", "-m", "x"])
    assert (command.script, command.module, command.args) == ("train.py", None, ["--steps", "3", "-m", "x"])
    assert command.options["nproc_per_node"] == 2 and command.options["max_restarts"] == 1
    module = parse_command(["-m", "pkg.train", "--nproc-per-node", "4"])
    assert (module.script, module.module, module.args) == (None, "pkg.train", ["--nproc-per-node", "4"])
    assert module.options["nproc_per_node"] is None  # worker mode: the option was the module's


@pytest.mark.parametrize(
    "argv, message",
    [([], "no SCRIPT"), (["--steps", "3", "t.py"], "unknown launcher option '--steps'"),
     (["--nproc-per-node", "two", "t.py"], "--nproc-per-node"), (["-m"], "-m")],
)  # fmt: skip
def test_bad_command_lines_name_the_argument(argv: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as raised:
        parse_command(argv)
    assert raised.value.code == 2 and message in capsys.readouterr().err


def test_torchrun_runs_the_launcher_in_worker_mode_on_every_worker() -> None:
    command = parse_command(["--nproc-per-node", "2", "--max-restarts", "3", "-m", "pkg.train", "--steps", "5"])
    assert torchrun_argv(command) == [
        "--nproc-per-node", "2", "--nnodes", "1", "--max-restarts", "3",
        "-m", "torchrec_het.launch", "-m", "pkg.train", "--steps", "5",
    ]  # fmt: skip
    endpoint = torchrun_argv(
        parse_command(["--nproc-per-node", "1", "--nnodes", "2", "--rdzv-endpoint", "h:29400", "t.py"])
    )
    assert endpoint[endpoint.index("--rdzv-endpoint") + 1] == "h:29400" and "c10d" in endpoint


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_importing_changes_nothing(tmp_path: Path) -> None:
    code = "import sys, torchrec_het, torchrec_het.launch; print(sorted(m for m in ('torch', 'torchrec_het.integration.registration') if m in sys.modules))"
    assert _run(["-c", code], tmp_path).stdout.strip() == "[]"


def test_worker_mode_runs_the_script_as_main_with_the_plugin_installed(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(WORKER_SCRIPT))
    done = _run(["-m", "torchrec_het.launch", str(script), "--steps", "3"], tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:3] == ["argv ['--steps', '3']", "name __main__", "installed True"]
    assert "HetEmbeddingBagCollectionSharder" in lines[3]


def test_missing_script_is_a_clear_error(tmp_path: Path) -> None:
    done = _run(["-m", "torchrec_het.launch", "--nproc-per-node", "2", "no_such.py", "--steps", "1"], tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "python -m torchrec_het.launch: can't open SCRIPT 'no_such.py': no such file"
    ]


@pytest.mark.parametrize(
    "argv, message",
    [(["--nproc-per-node", "0", "t.py"], "--nproc-per-node must be >= 1, got 0"),
     (["--nproc-per-node", "1", "--max-restarts", "-1", "t.py"], "--max-restarts must be >= 0, got -1"),
     (["--nproc-per-node", "1", "-m", "no_such_module_here"], "no module named 'no_such_module_here' (-m)")],
)  # fmt: skip
def test_bad_launcher_values_are_configuration_errors(argv: list[str], message: str, capsys) -> None:
    from torchrec_het import launch

    with pytest.raises(SystemExit) as raised:
        launch.main(argv)
    assert raised.value.code == launch.CONFIGURATION_ERROR_EXIT
    assert capsys.readouterr().err == f"python -m torchrec_het.launch: {message}\n"


def test_restarts_get_a_store_per_attempt(monkeypatch) -> None:
    import torch.distributed.run

    from torchrec_het import launch

    monkeypatch.setenv(launch.SHARE_STORE_ENV, "")  # restored (unset) after the test
    monkeypatch.delenv(launch.SHARE_STORE_ENV)
    monkeypatch.setattr(torch.distributed.run, "main", lambda argv: None)
    assert launch.main(["--nproc-per-node", "2", "--max-restarts", "1", __file__]) == 0
    assert os.environ[launch.SHARE_STORE_ENV] == "1"  # see pytorch/pytorch#135712


@pytest.mark.parametrize("content", [None, b"not a profile"])
def test_a_bad_profile_stops_the_launcher_before_any_worker(tmp_path: Path, monkeypatch, capsys, content) -> None:
    import torch.distributed.run

    from torchrec_het import launch

    path = tmp_path / "profile.pt"
    if content is not None:
        path.write_bytes(content)
    monkeypatch.setenv("TORCHREC_HET_PROFILE", str(path))
    monkeypatch.setattr(torch.distributed.run, "main", lambda argv: pytest.fail("torchrun started"))
    with pytest.raises(SystemExit) as raised:
        launch.main(["--nproc-per-node", "2", "--max-restarts", "3", __file__])
    assert raised.value.code == 2
    (message,) = capsys.readouterr().err.splitlines()
    assert message.startswith("python -m torchrec_het.launch: $TORCHREC_HET_PROFILE=") and str(path) in message, message


def test_a_missing_profile_is_one_message_from_the_launcher(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('a worker ran')\n")
    missing = tmp_path / "nowhere.pt"
    done = subprocess.run(
        [sys.executable, "-m", "torchrec_het.launch", "--nproc-per-node", "2", "--max-restarts", "3", str(script)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=dict(os.environ, TORCHREC_HET_PROFILE=str(missing)),
    )  # fmt: skip
    assert done.returncode == 2 and "a worker ran" not in done.stderr + done.stdout
    assert done.stderr.strip().splitlines() == [
        f"python -m torchrec_het.launch: $TORCHREC_HET_PROFILE='{missing}': no such access profile file"
    ], done.stderr


def test_a_missing_profile_in_worker_mode_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """Under plain torchrun or torchx (no launcher to check first), the worker's install() says it."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script ran')\n")
    missing = tmp_path / "nowhere.pt"
    done = subprocess.run(
        [sys.executable, "-m", "torchrec_het.launch", str(script)], cwd=tmp_path, capture_output=True, text=True,
        timeout=120, env=dict(os.environ, TORCHREC_HET_PROFILE=str(missing)),
    )  # fmt: skip
    assert done.returncode == 2 and "the script ran" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"python -m torchrec_het.launch: $TORCHREC_HET_PROFILE='{missing}': no such access profile file"
    ], done.stderr


def test_a_node_of_a_multi_host_job_passes_its_address_and_rendezvous_settings() -> None:
    argv = [
        "--nproc-per-node",
        "1",
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        "10.0.0.1:29400",
        "--local-addr",
        "10.0.0.1",
        "--rdzv-conf",
        "is_host=1",
        "train.py",
        "--steps",
        "3",
    ]
    got = torchrun_argv(parse_command(argv))
    assert got[got.index("--local-addr") + 1] == "10.0.0.1" and got[got.index("--rdzv-conf") + 1] == "is_host=1"
    assert got[-5:] == ["-m", "torchrec_het.launch", "train.py", "--steps", "3"]


def test_help_lists_every_setting() -> None:
    from torchrec_het.integration.env_settings import SETTINGS, env_settings

    assert set(env_settings()) == {s.argument for s in SETTINGS}  # install() reads exactly the listed ones
    done = _run(["-m", "torchrec_het.launch", "--help"], REPO)
    assert done.returncode == 0, done.stderr
    for setting in SETTINGS:
        assert setting.variable in done.stdout, (setting.variable, done.stdout)


def _profile_of(path: Path, table: str, rows: int) -> str:
    import torch

    from torchrec_het.replication.profile import AccessProfile, save_profile

    save_profile(AccessProfile((table,), (rows,), (torch.ones(rows, dtype=torch.int64),), 1), str(path))
    return str(path)


@pytest.mark.parametrize(
    "table, rows, mismatch",
    [("other", 50, "names none of the model's tables: it has ['other']"),
     ("t_cat_0", 7, "counts other row numbers than the model's tables: [\"'t_cat_0' has 7 rows in the profile")],
)  # fmt: skip
def test_a_profile_that_does_not_fit_the_model_ends_the_job_once_on_one_line(
    tmp_path: Path, table, rows, mismatch
) -> None:
    """Workers find it (the launcher cannot: it does not know the model); torchrun restarts nothing,
    and the launcher's output ends on the one line naming the variable, the path and the mismatch."""
    path = _profile_of(tmp_path / "profile.pt", table, rows)
    done = subprocess.run(
        [sys.executable, "-m", "torchrec_het.launch", "--nproc-per-node", "2", "--max-restarts", "2",
         "recipes/train_dlrm.py", "--steps", "5"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ, TORCHREC_HET_PROFILE=path),
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"python -m torchrec_het.launch: $TORCHREC_HET_PROFILE='{path}': the access profile "), last
    assert mismatch in last, last
    assert [line for line in done.stderr.splitlines() if "TORCHREC_HET_PROFILE=" in line] == [last]
    output = done.stdout + done.stderr
    assert "attempt 0" in output and "attempt 1" not in output and "Connection closed" not in output, output[-3000:]


def test_a_worker_ends_on_a_configuration_error_without_a_fault(tmp_path: Path) -> None:
    """Under the launcher (its file named): the line goes to the file and the worker exits 0, so
    torchrun restarts nothing; alone: the line, exit 2."""
    from torchrec_het.launch import CONFIGURATION_ERROR_ENV

    script = tmp_path / "train.py"
    script.write_text(
        "from torchrec_het.errors import ConfigurationError\nraise ConfigurationError('a profile\\nof other tables')\n"
    )
    alone = _run(["-m", "torchrec_het.launch", str(script)], tmp_path)
    assert (
        alone.returncode == 2
        and alone.stderr.strip().splitlines()[-1] == "python -m torchrec_het.launch: a profile of other tables"
    )
    report = tmp_path / "error.txt"
    launched = subprocess.run(
        [sys.executable, "-m", "torchrec_het.launch", str(script)], cwd=tmp_path, capture_output=True, text=True,
        timeout=120, env=dict(os.environ, **{CONFIGURATION_ERROR_ENV: str(report)}),
    )  # fmt: skip
    assert launched.returncode == 0, launched.stderr
    assert report.read_text() == "python -m torchrec_het.launch: a profile of other tables"


def _fp16_registry() -> dict:
    import torch
    from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry

    return get_qcomm_codecs_registry(QCommsConfig(CommType.FP16, CommType.BF16), device=torch.device("cpu"))


def test_the_swap_keeps_a_stock_sharders_codecs_and_fused_params() -> None:
    """The sharders a trainer builds itself become the plugin's with their own registry and fused
    params; other sharders stay; without install() nothing changes."""
    from torchrec.distributed.embedding import EmbeddingCollectionSharder
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fused_embeddingbag import FusedEmbeddingBagCollectionSharder

    import torchrec_het
    from torchrec_het.integration.registration import swap_stock_sharders
    from torchrec_het.sharders import HetEmbeddingBagCollectionSharder, HetEmbeddingCollectionSharder

    registry, fused = _fp16_registry(), {"learning_rate": 0.1}
    other = FusedEmbeddingBagCollectionSharder()
    given = [
        EmbeddingBagCollectionSharder(fused_params=fused, qcomm_codecs_registry=registry),
        EmbeddingCollectionSharder(qcomm_codecs_registry=registry, use_index_dedup=True),
        other,
    ]
    assert swap_stock_sharders(given) == given  # not installed
    torchrec_het.install(link_probe=False)
    try:
        bag, seq, kept = swap_stock_sharders(given)
    finally:
        torchrec_het.uninstall()
    assert type(bag) is HetEmbeddingBagCollectionSharder and type(seq) is HetEmbeddingCollectionSharder
    assert bag.qcomm_codecs_registry is registry and seq.qcomm_codecs_registry is registry
    assert bag.fused_params == fused and seq._use_index_dedup and kept is other


CODEC_TRAINER = """
import os, socket, torch, torch.distributed as dist
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

with socket.socket() as probe:
    probe.bind(("127.0.0.1", 0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(probe.getsockname()[1]))
dist.init_process_group("gloo", rank=0, world_size=1)
registry = get_qcomm_codecs_registry(QCommsConfig(CommType.FP16, CommType.BF16), device=torch.device("cpu"))
sharders = [EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry)]
tables = [EmbeddingBagConfig(name="t", feature_names=["f"], embedding_dim=8, num_embeddings=100)]
ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"), batch_size=8)
seen = []
torchrec_planner = type(planner).__mro__[1]  # TorchRec's, which the plugin's planner extends: what it plans with
torchrec_plan = torchrec_planner.plan
torchrec_planner.plan = lambda self, module, given: seen.extend(given) or torchrec_plan(self, module, given)
plan = planner.collective_plan(ebc, sharders, dist.GroupMember.WORLD)
model = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan, sharders=sharders)
sharder = model._sharder_map[EmbeddingBagCollection]
print("planner got", type(seen[0]).__name__, seen[0].qcomm_codecs_registry is registry)
print("model got", type(sharder).__name__, sharder.qcomm_codecs_registry is registry)
print("sharded module", model.module._qcomm_codecs_registry is registry)
dist.destroy_process_group()
"""


def test_the_launcher_gives_a_trainers_codecs_to_the_plugin_sharders_it_plans_and_shards_with(tmp_path: Path) -> None:
    """An unchanged trainer that builds ``EmbeddingBagCollectionSharder(qcomm_codecs_registry=...)``:
    under the launcher its planner and ``DistributedModelParallel`` get the plugin's sharder, with that registry."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(CODEC_TRAINER))
    done = subprocess.run(
        [sys.executable, "-m", "torchrec_het.launch", str(script)], cwd=tmp_path, capture_output=True, text=True,
        timeout=180, env=dict(os.environ, TORCHREC_HET_LINK_PROBE="0", PYTHONWARNINGS="ignore"),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines()[-3:] == [
        "planner got HetEmbeddingBagCollectionSharder True",
        "model got HetEmbeddingBagCollectionSharder True",
        "sharded module True",
    ], done.stdout
