"""``torchx run -s local_cwd recipes/components.py:train`` trains the recipe for a few steps on 2 ranks."""

import os
import sys
from pathlib import Path

from torchrec_het_testing.launched import LaunchedRun

REPO = Path(__file__).resolve().parents[2]


def test_torchx_local_cwd_train_smoke(tmp_path: Path) -> None:
    bin_dir = Path(sys.executable).parent  # torchx and torchrun of this environment
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", PYTHONWARNINGS="ignore")
    argv = [
        str(bin_dir / "torchx"), "run", "-s", "local_cwd", "recipes/components.py:train",
        "--steps", "2", "--checkpoint_path", str(tmp_path / "ckpt"), "--eval_batches", "1",
    ]  # fmt: skip
    run = LaunchedRun(argv, REPO, tmp_path / "torchx.stderr", env)  # torchx shows the job's output on stderr
    code = run.finish(240)
    log = run.stderr_path.read_text()
    assert code == 0 and "Job finished: SUCCEEDED" in log, run.report()
    assert "[0]:final step 2 auc " in log, run.report()
    assert (tmp_path / "ckpt" / "step_2" / "COMPLETE").exists()
