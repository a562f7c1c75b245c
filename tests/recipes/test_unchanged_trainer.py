"""An unchanged TorchRec-style DLRM trainer (``recipes/train_dlrm.py``: stock planner,
``get_default_sharders()``, nothing of the plugin) picks the plugin's sharding types up
when started through ``python -m torchrec_het.launch`` with evidence of skew (a profile, or a
stated skew), keeps TorchRec's without it, and without the launcher."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from torchrec_het_testing.stated_plan_figures import SLOW_LINK_PLAN

REPO = Path(__file__).resolve().parents[2]
RECIPE = ["recipes/train_dlrm.py", "--preset", "smoke", "--steps", "2", "--eval-batches", "1", "--print-plan"]
PLUGIN = {"het_row_replicated", "het_cached_row_wise"}


AUCS: dict[str, float] = {}
STDERR: dict[str, str] = {}


def _run(argv: list[str], name: str, **env: str) -> str:
    run = subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONWARNINGS="ignore", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **env),
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    final = re.search(r"^final step 2 auc (0\.\d+)$", run.stdout, re.M)
    assert final, run.stdout[-2000:]  # a finished training
    AUCS[name] = float(final.group(1))
    STDERR[name] = run.stderr
    return run.stdout


def _planned_types(stdout: str) -> set[str]:
    """Sharding types in the printed plan (``param | sharding type | compute kernel | ranks`` rows)."""
    return set(re.findall(r"^t_cat_\d+\s+\|\s+(\w+)\s+\|", stdout, re.M))


# a slow link and fixed compute stated: the plugin's plan beats TorchRec's by more than the model's error,
# whatever the machine running the tests measures (these tests check the launcher's plumbing, not the choice)
SLOW_LINK = SLOW_LINK_PLAN


@pytest.fixture(scope="module")
def on_par(tmp_path_factory) -> str:
    """A compute-cost table of a machine where the plugin's lookups cost what row_wise's do, so the
    plan follows the bytes: these tests check that the launcher's evidence reaches an unchanged
    trainer's plan and lookups. (The table shipped with the package, measured on a 2-core CPU VM,
    plans TorchRec's types at the smoke sizes: tests/unit/test_compute_pricing.py.)"""
    from torchrec_het.planner.compute_costs import save_bytes_only_table

    path = tmp_path_factory.mktemp("costs") / "on_par.json"
    return str(save_bytes_only_table(path, "tests: lookups on par with row_wise"))


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("profile") / "smoke.pt")
    run = subprocess.run(
        [sys.executable, "-m", "torchrec_het_bench.profile", "--preset", "smoke", "--steps", "40", "--every", "4", "--out", path],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    return path


def test_without_the_launcher_the_trainer_plans_stock_types() -> None:
    stdout = _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *RECIPE], "stock")
    types = _planned_types(stdout)
    assert types and not types & PLUGIN, types


def test_through_the_launcher_without_a_profile_the_trainer_plans_stock_types() -> None:
    """No evidence of skew (uniform ids would look the same): TorchRec's plan, and stderr says why, once."""
    stdout = _run([sys.executable, "-m", "torchrec_het.launch", "--nproc-per-node", "2", *RECIPE], "no_profile")
    types = _planned_types(stdout)
    assert types and not types & PLUGIN, types
    rule = [line for line in STDERR["no_profile"].splitlines() if "torchrec_het: no access profile" in line]
    assert len(rule) == 1 and "offers only TorchRec's sharding types" in rule[0], STDERR["no_profile"][-2000:]


def test_through_the_launcher_with_a_stated_skew_the_trainer_plans_the_plugin_cache(on_par: str) -> None:
    stdout = _run(
        [sys.executable, "-m", "torchrec_het.launch", "--nproc-per-node", "2", *RECIPE],
        "cache",
        TORCHREC_HET_ALPHA="1.05",
        TORCHREC_HET_COMPUTE_COSTS=on_par,
        **SLOW_LINK,
    )
    assert _planned_types(stdout) == {"het_cached_row_wise"}, _planned_types(stdout)
    assert "HC = het_cached_row_wise" in stdout and re.search(r"HC: 26\b", stdout)  # the planner's stats table


def test_through_the_launcher_with_a_profile_the_trainer_plans_row_replication(profile: str, on_par: str) -> None:
    stdout = _run(
        [sys.executable, "-m", "torchrec_het.launch", "--nproc-per-node", "2", *RECIPE],
        "replicated",
        TORCHREC_HET_PROFILE=profile,
        TORCHREC_HET_COMPUTE_COSTS=on_par,
        **SLOW_LINK,
    )
    assert "het_row_replicated" in _planned_types(stdout), _planned_types(stdout)
    assert "HR = het_row_replicated" in stdout


def test_through_the_launcher_with_online_counting_and_a_stated_skew_the_trainer_plans_row_replication(
    on_par: str,
) -> None:
    """Online counts come after planning; the stated skew is what the planner prices row replication from."""
    stdout = _run(
        [sys.executable, "-m", "torchrec_het.launch", "--nproc-per-node", "2", *RECIPE], "online",
        TORCHREC_HET_ONLINE_PROFILE_STEPS="1", TORCHREC_HET_ALPHA="1.05", TORCHREC_HET_COMPUTE_COSTS=on_par, **SLOW_LINK,
    )  # fmt: skip
    assert "het_row_replicated" in _planned_types(stdout), _planned_types(stdout)


def test_exact_plugin_plans_train_like_the_stock_plan() -> None:
    """Same starting weights (by row), exact settings (no staleness): the same held-out AUC."""
    if not {"stock", "cache", "replicated", "online"} <= set(AUCS):
        pytest.skip(f"needs the three runs above (have {sorted(AUCS)})")
    assert AUCS["cache"] == pytest.approx(AUCS["stock"], abs=1e-3), AUCS
    assert AUCS["replicated"] == pytest.approx(AUCS["stock"], abs=1e-3), AUCS
    assert AUCS["online"] == pytest.approx(AUCS["stock"], abs=1e-3), AUCS  # hot rows chosen after step 1


QCOMMS = ["--fwd-comm-precision", "fp16", "--bwd-comm-precision", "bf16"]


def test_the_codec_flags_build_torchrecs_registry_and_name_a_bad_value(capsys) -> None:
    """The stock path: the EmbeddingBagCollection sharder carries ``get_qcomm_codecs_registry`` for
    the CPU (bf16 runs as fp16 there); other values are refused, naming the flag."""
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.fbgemm_qcomm_codec import CommType

    from torchrec_het_bench.recipes import train_dlrm

    args = train_dlrm.parse_args(QCOMMS)
    assert (args.fwd_comm_precision, args.bwd_comm_precision) == (CommType.FP16, CommType.BF16)
    registry = train_dlrm.codecs_registry(args.fwd_comm_precision, args.bwd_comm_precision, train_dlrm.DEVICE)
    assert "POOLED_EMBEDDINGS_ALL_TO_ALL fp16/fp16" in train_dlrm.describe_codecs(registry)
    (bag,) = [s for s in train_dlrm.build_sharders(registry) if isinstance(s, EmbeddingBagCollectionSharder)]
    assert type(bag) is EmbeddingBagCollectionSharder and bag.qcomm_codecs_registry is registry
    assert train_dlrm.codecs_registry(CommType.FP32, CommType.FP32, train_dlrm.DEVICE) is None
    with pytest.raises(SystemExit):
        train_dlrm.parse_args(["--bwd-comm-precision", "fp12"])
    error = capsys.readouterr().err
    assert "--bwd-comm-precision" in error and "'fp12'" in error and "fp16, bf16" in error, error
    with pytest.raises(SystemExit):  # a CommType FBGEMM's CPU codecs fail on, mid-step, on every rank
        train_dlrm.parse_args(["--fwd-comm-precision", "fp8"])
    assert "--fwd-comm-precision fp8 does not run on CPU" in capsys.readouterr().err


def test_through_the_launcher_the_trainer_keeps_its_quantized_comms(on_par: str) -> None:
    """``--fwd-comm-precision fp16 --bwd-comm-precision bf16`` under the launcher with a stated skew:
    the plugin's cache is planned and trained with the trainer's codecs (fp16 both ways on CPU)."""
    stdout = _run(
        [sys.executable, "-m", "torchrec_het.launch", "--nproc-per-node", "2", *RECIPE, *QCOMMS],
        "cache_fp16",
        TORCHREC_HET_ALPHA="1.05",
        TORCHREC_HET_COMPUTE_COSTS=on_par,
        **SLOW_LINK,
    )
    assert _planned_types(stdout) == {"het_cached_row_wise"}, _planned_types(stdout)
    line = re.search(r"^qcomms fp16/bf16 runs (.+)$", stdout, re.M)
    assert line and "POOLED_EMBEDDINGS_ALL_TO_ALL fp16/fp16" in line.group(1), stdout[-2000:]


def test_through_the_launcher_embedding_staleness_makes_the_trainer_hybrid(on_par: str) -> None:
    """``TORCHREC_HET_EMBEDDING_STALENESS=1``: the trainer's own ``TrainPipelineSparseDist(...)`` is the
    hybrid pipeline (the log says so) and trains its het_cached_row_wise plan (stated skew) to the end."""
    argv = [sys.executable, "-m", "torchrec_het.launch", "--nproc-per-node", "2", *RECIPE]
    run = subprocess.run(
        argv, cwd=REPO, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONWARNINGS="ignore", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                 TORCHREC_HET_EMBEDDING_STALENESS="1", TORCHREC_HET_ALPHA="1.05", TORCHREC_HET_COMPUTE_COSTS=on_par, **SLOW_LINK),
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "runs as the hybrid pipeline, embedding_staleness=1" in run.stderr, run.stderr[-2000:]
    assert re.search(r"^final step 2 auc 0\.\d+$", run.stdout, re.M), run.stdout[-2000:]
