"""torchx components of torchrec_het.

Run from the repository root with the virtual environment's bin on PATH
(torchx starts ``torchrun`` from PATH):

    torchx run -s local_cwd recipes/components.py:bench --preset smoke
    torchx run -s local_cwd recipes/components.py:train --steps 20
    torchx run -s local_cwd recipes/components.py:evaluate

``train`` and ``evaluate`` run the DLRM recipe (``torchrec_het_bench.recipes.train_dlrm``) under
``python -m torchrec_het.launch``, so its stock planner and sharders are the plugin's.
"""

import torchx.specs as specs
from torchx.components.dist import ddp

LAUNCHER = "torchrec_het.launch"
RECIPE = "torchrec_het_bench.recipes.train_dlrm"


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
        m="torchrec_het_bench",
        name="torchrec_het_bench",
        j=j,
        cpu=cpu,
        memMB=memMB,
        max_retries=max_retries,
    )


def train(
    steps: int = 100,
    preset: str = "smoke",
    data: str = "",
    batch_size: int = 0,
    learning_rate: float = 0.05,
    seed: int = 0,
    checkpoint_path: str = "checkpoints/train_dlrm",
    checkpoint_every: int = 50,
    resume: bool = True,
    eval_batches: int = 4,
    print_plan: bool = False,
    save_weights: str = "",
    fwd_comm_precision: str = "fp32",
    bwd_comm_precision: str = "fp32",
    j: str = "1x2",
    cpu: int = 2,
    memMB: int = 8192,
    max_retries: int = 0,
) -> specs.AppDef:
    """Trains the DLRM recipe with torchrec_het installed (``python -m torchrec_het.launch``).

    Args:
        steps: training steps in all; a resumed run goes on to this step
        preset: table and layer sizes: smoke or default
        data: Criteo TSV file/directory or npy directory; empty for synthetic data
        batch_size: samples per rank per step; 0 takes the preset's
        learning_rate: learning rate of the embedding and dense optimizers
        seed: seed of the initial weights and the synthetic data
        checkpoint_path: checkpoint directory (local path or file:// URI), relative to the directory torchx
            runs in (default checkpoints/train_dlrm, which .gitignore leaves out); empty for none
        checkpoint_every: save a checkpoint every this many steps (and at the end)
        resume: continue from the newest complete checkpoint under checkpoint_path, if any; a run already
            at steps trains nothing and says so (--resume False starts fresh)
        eval_batches: held-out batches per rank for the final AUC
        print_plan: print the sharding plan and the planner's statistics
        save_weights: file that rank 0 writes the unsharded weights to at the end; empty for none
        fwd_comm_precision: TorchRec's quantized comms, forward: fp32 (none), fp16, bf16, int8 or mx4
        bwd_comm_precision: TorchRec's quantized comms, backward (gradients); on CPU bf16 runs as fp16
        j: {nnodes}x{nproc_per_node}, e.g. 1x2 for two ranks on one host
        cpu: CPUs per replica
        memMB: memory per replica, MiB
        max_retries: times the scheduler reruns the job after a failure (it resumes when resume is set)
    """
    return ddp(
        "-m",
        RECIPE,
        "--steps",
        str(steps),
        "--preset",
        preset,
        "--data",
        data,
        "--batch-size",
        str(batch_size),
        "--learning-rate",
        str(learning_rate),
        "--seed",
        str(seed),
        "--checkpoint-path",
        checkpoint_path,
        "--checkpoint-every",
        str(checkpoint_every),
        "--eval-batches",
        str(eval_batches),
        "--save-weights",
        save_weights,
        "--fwd-comm-precision",
        fwd_comm_precision,
        "--bwd-comm-precision",
        bwd_comm_precision,
        *_flag("--resume", resume),
        *_flag("--print-plan", print_plan),
        m=LAUNCHER,
        name="train_dlrm",
        j=j,
        cpu=cpu,
        memMB=memMB,
        max_retries=max_retries,
    )


def evaluate(
    checkpoint_path: str = "checkpoints/train_dlrm",
    preset: str = "smoke",
    data: str = "",
    batch_size: int = 0,
    seed: int = 0,
    eval_batches: int = 4,
    j: str = "1x2",
    cpu: int = 2,
    memMB: int = 8192,
) -> specs.AppDef:
    """Prints the AUC of the newest complete checkpoint of the DLRM recipe.

    Args:
        checkpoint_path: checkpoint directory that train wrote (local path or file:// URI)
        preset: table and layer sizes the checkpoint was trained with: smoke or default
        data: Criteo TSV file/directory or npy directory; empty for synthetic data
        batch_size: samples per rank per evaluation batch; 0 takes the preset's
        seed: seed of the synthetic data (as in training)
        eval_batches: held-out batches per rank
        j: {nnodes}x{nproc_per_node}, e.g. 1x2 for two ranks on one host
        cpu: CPUs per replica
        memMB: memory per replica, MiB
    """
    return ddp(
        "-m",
        RECIPE,
        "--evaluate-only",
        "--checkpoint-path",
        checkpoint_path,
        "--preset",
        preset,
        "--data",
        data,
        "--batch-size",
        str(batch_size),
        "--seed",
        str(seed),
        "--eval-batches",
        str(eval_batches),
        m=LAUNCHER,
        name="evaluate_dlrm",
        j=j,
        cpu=cpu,
        memMB=memMB,
    )


def _flag(flag: str, on: bool) -> list[str]:
    """``[flag]`` when ``on``, else nothing (a store_true option of the recipe)."""
    return [flag] if on else []
