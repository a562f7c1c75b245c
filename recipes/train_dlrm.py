"""Trains TorchRec's DLRM on Criteo-like data with the sharding plan TorchRec's planner picks.

A plain TorchRec trainer, written the way TorchRec's DLRM example is: a ``DLRMTrain``
with its tables on the meta device, a stock ``EmbeddingShardingPlanner`` with
``get_default_sharders()``, ``DistributedModelParallel``, row-wise Adagrad fused into the
embedding backward and Adagrad on the dense part (one ``CombinedOptimizer``), stepped by
TorchRec's ``TrainPipelineSparseDist`` (``--pipeline plain``: forward, backward, step, one
batch at a time). It uses
nothing of torchrec_het but its data (``torchrec_het_bench.data``) and a plan-independent
initialization of the tables (``init_tables_by_row``: every plan starts from the same
weights, so runs compare), so it runs unchanged on stock TorchRec; started through ``python -m torchrec_het.launch`` the same code plans
and shards with the plugin:

    torchrun --nproc-per-node 2 recipes/train_dlrm.py --steps 100
    python -m torchrec_het.launch --nproc-per-node 2 recipes/train_dlrm.py --steps 100

Quantized comms (TorchRec's): ``--fwd-comm-precision fp16 --bwd-comm-precision bf16`` builds the
``EmbeddingBagCollectionSharder`` with ``get_qcomm_codecs_registry(QCommsConfig(...), device=cpu)``
(the device the trainer runs on, as TorchRec's examples pass it; for cpu TorchRec's registry runs
bf16 as fp16, with a warning). The planner and ``DistributedModelParallel`` get that sharder; under
the launcher the plugin's sharder that replaces it keeps its registry.

Checkpoints (``--checkpoint-path``) are ``torch.distributed.checkpoint`` directories
``<path>/step_<n>/`` holding the model's and optimizer's state dicts and the step; the
data is a function of the step, so the step is the data position. A checkpoint counts
once its ``COMPLETE`` marker exists (written last, by rank 0, after every rank saved).

Output lines (rank 0): ``step <n> loss <x>``, ``checkpoint step <n> saved <dir>``,
``loaded checkpoint step <n> <dir>``, ``resumed at step <n> of <n>: trained nothing, ...`` (a resume
that finds the run finished), ``final step <n> auc <x>``; every rank prints
``worker rank <r> pid <p> attempt <a>`` first, and rank 0 prints
``trained <n> steps in <s> s (<x> it/s)`` when training ends; with quantized comms rank 0 first
prints ``qcomms <fwd>/<bwd> runs <collective> <fwd>/<bwd>, ...`` (the codecs the registry holds).
"""

import argparse
import logging
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torchrec.optim
from iopath.common.file_io import NativePathHandler, PathManager
from torch.distributed.tensor import DTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.fbgemm_qcomm_codec import CommType, QCommsConfig, get_qcomm_codecs_registry
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import KernelConfig, TopologyFactory, TrainerConfig
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.models.dlrm import DLRM, DLRMTrain
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from torchrec_het import _compat
from torchrec_het_bench.data import DataConfig, binary_auc, open_source, preset_table_sizes
from torchrec_het_bench.table_init import init_tables_by_row  # plan-independent starting weights

COMPLETE = "COMPLETE"  # marker file of a finished checkpoint
DEVICE = torch.device("cpu")  # where the trainer runs, and its collectives (gloo)
PRECISIONS = tuple(kind.value for kind in CommType)  # fp32 fp16 bf16 fp8 int8 mx4
ON_CPU = tuple(name for name in PRECISIONS if name != CommType.FP8.value)  # FBGEMM's CPU codecs fail on fp8


@dataclass(frozen=True)
class Preset:
    """Model and batch sizes (tables: Criteo's 26, clamped to the preset's row bounds)."""

    table_sizes: tuple[int, ...]
    embedding_dim: int
    dense_arch: tuple[int, ...]
    over_arch: tuple[int, ...]
    batch_size: int


PRESETS = {
    "smoke": lambda: Preset(preset_table_sizes("smoke"), 16, (64, 16), (64, 1), 256),
    "default": lambda: Preset(preset_table_sizes("default"), 64, (256, 64), (256, 128, 1), 1024),
}


def build_parser() -> argparse.ArgumentParser:
    """The recipe's command line."""
    parser = argparse.ArgumentParser(description="Train TorchRec's DLRM, sharded by TorchRec's planner.")
    parser.add_argument("--data", default=None, help="Criteo TSV file/dir or npy dir; omit (or '') for synthetic data")
    parser.add_argument("--preset", default="smoke", choices=sorted(PRESETS), help="table and layer sizes")
    parser.add_argument("--steps", type=int, default=100, help="training steps in all (a resumed run counts on)")
    parser.add_argument("--batch-size", type=int, default=0, help="samples per rank per step (0: the preset's)")
    parser.add_argument("--learning-rate", type=float, default=0.05, help="embedding and dense learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights and the synthetic data")
    parser.add_argument(
        "--alpha", type=float, default=DataConfig.alpha,
        help=f"Zipf exponent of the synthetic ids (0: uniform; default {DataConfig.alpha}); ignored with --data",
    )  # fmt: skip
    parser.add_argument(
        "--checkpoint-path", default=None, help="checkpoint directory (local path or file:// URI); omit for none"
    )
    parser.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: only at the end)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    parser.add_argument("--eval-batches", type=int, default=4, help="held-out batches per rank for the AUC")
    parser.add_argument("--evaluate-only", action="store_true", help="load the newest checkpoint, print its AUC")
    parser.add_argument("--print-plan", action="store_true", help="print the sharding plan and planner stats")
    parser.add_argument("--save-weights", default=None, help="rank 0 saves the unsharded weights here (torch.save)")
    parser.add_argument("--log-every", type=int, default=1, help="print the loss every N steps")
    parser.add_argument(
        "--pg-timeout", type=float, default=None, metavar="SECONDS",
        help="process group timeout: a collective that waits longer for its peers fails (default: torch's, "
        "30 min for gloo; under python -m torchrec_het.launch, $TORCHREC_HET_PG_TIMEOUT when set)",
    )  # fmt: skip
    for flag, way in (("--fwd-comm-precision", "embeddings"), ("--bwd-comm-precision", "their gradients")):
        parser.add_argument(
            flag, type=comm_type, default=CommType.FP32, metavar="|".join(ON_CPU),
            help=f"TorchRec's quantized comms: the precision {way} travel in between ranks (default fp32: "
            "none); on CPU TorchRec runs bf16 as fp16",
        )  # fmt: skip
    parser.add_argument(
        "--pipeline", default="sparse_dist", choices=("sparse_dist", "plain"),
        help="sparse_dist: TorchRec's TrainPipelineSparseDist (the next batch's input dist overlaps this step); "
        "plain: forward, backward, optimizer step, one batch at a time",
    )  # fmt: skip
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parses and checks ``argv``; errors name the bad argument."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("data", "checkpoint_path", "save_weights"):  # '' (as torchx passes "unset") is None
        setattr(args, name, getattr(args, name) or None)
    for name in ("steps", "batch_size", "checkpoint_every", "eval_batches"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.alpha < 0:
        parser.error(f"--alpha must be >= 0, got {args.alpha}")
    if args.log_every < 1:
        parser.error(f"--log-every must be >= 1, got {args.log_every}")
    if args.pg_timeout is not None and not 0 < args.pg_timeout < float("inf"):
        parser.error(f"--pg-timeout must be a number of seconds > 0, got {args.pg_timeout}")
    for flag in ("--fwd-comm-precision", "--bwd-comm-precision"):
        if getattr(args, flag[2:].replace("-", "_")) is CommType.FP8 and DEVICE.type == "cpu":
            parser.error(f"{flag} fp8 does not run on CPU, where this trainer runs (FBGEMM's CPU codecs "
                         "fail on TorchRec's all-to-all); use fp16, bf16, int8 or mx4")  # fmt: skip
    for flag, given in (("--resume", args.resume), ("--evaluate-only", args.evaluate_only),
                        ("--checkpoint-every", args.checkpoint_every > 0)):  # fmt: skip
        if given and args.checkpoint_path is None:
            parser.error(f"{flag} needs --checkpoint-path")
    if args.evaluate_only and args.eval_batches < 1:
        parser.error("--evaluate-only needs --eval-batches >= 1")
    if args.checkpoint_path is not None:
        try:
            args.checkpoint_dir = local_dir(args.checkpoint_path)
        except ValueError as error:
            parser.error(f"--checkpoint-path: {error}")
    return args


# ---- paths -----------------------------------------------------------------------------------


class FileURIHandler(NativePathHandler):
    """iopath handler of ``file://`` URIs: the local file system."""

    PREFIX = "file://"

    def _get_supported_prefixes(self) -> list[str]:
        return [self.PREFIX]

    def _strip(self, path: str) -> str:
        return path[len(self.PREFIX) :] if path.startswith(self.PREFIX) else path

    def _get_path_with_cwd(self, path: str) -> str:
        return super()._get_path_with_cwd(self._strip(path))

    def _get_local_path(self, path: str, force: bool = False, **kwargs) -> str:
        return super()._get_local_path(self._strip(path), force=force, **kwargs)


def path_manager() -> PathManager:
    manager = PathManager()
    manager.register_handler(FileURIHandler())
    return manager


def local_dir(path: str) -> Path:
    """The local directory ``path`` (a local path or ``file://`` URI) names."""
    local = path_manager().get_local_path(path)
    if "://" in local:
        raise ValueError(f"{path!r} is not local; use a local path or a file:// URI")
    return Path(local)


# ---- quantized comms -------------------------------------------------------------------------


def comm_type(name: str) -> CommType:
    """TorchRec's ``CommType`` named ``name`` (``fp16``, ``bf16``, ...); the flags' type."""
    if name.lower() not in PRECISIONS:
        raise argparse.ArgumentTypeError(f"unknown precision {name!r}; expected one of {', '.join(PRECISIONS)}")
    return CommType(name.lower())


def codecs_registry(forward: CommType, backward: CommType, device: torch.device) -> dict | None:
    """TorchRec's ``qcomm_codecs_registry`` for ``device`` (None: fp32 both ways, no codecs)."""
    return get_qcomm_codecs_registry(
        QCommsConfig(forward_precision=forward, backward_precision=backward), device=device
    )


def describe_codecs(registry: dict) -> str:
    """``<collective> <forward>/<backward>`` for each collective of ``registry``, as its codecs encode."""

    def precision(codec) -> str:
        return _compat.codec_precision(codec) or type(codec).__name__  # FBGEMM's codec

    return ", ".join(f"{op} {precision(c.forward)}/{precision(c.backward)}" for op, c in registry.items())


def build_sharders(registry: dict | None) -> list:
    """``get_default_sharders()``; with a codecs registry, its EmbeddingBagCollection sharder is one built with it."""
    sharders = get_default_sharders()
    if registry is None:
        return sharders
    return [
        EmbeddingBagCollectionSharder(qcomm_codecs_registry=registry)
        if isinstance(sharder, EmbeddingBagCollectionSharder)
        else sharder
        for sharder in sharders
    ]


# ---- model -----------------------------------------------------------------------------------


def build_model(preset: Preset, feature_names: list[str], num_dense: int) -> DLRMTrain:
    """DLRM with one table per sparse feature, the tables on the meta device."""
    tables = [
        EmbeddingBagConfig(
            name=f"t_{feature}", embedding_dim=preset.embedding_dim, num_embeddings=rows, feature_names=[feature]
        )
        for feature, rows in zip(feature_names, preset.table_sizes, strict=True)
    ]
    return DLRMTrain(
        DLRM(
            embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
            dense_in_features=num_dense,
            dense_arch_layer_sizes=list(preset.dense_arch),
            over_arch_layer_sizes=list(preset.over_arch),
            dense_device=torch.device("cpu"),
        )
    )


def build_topology() -> Topology:
    """The job's ranks on CPU, built as TorchRec asks (``TopologyFactory``: a ``Topology`` built
    directly makes TorchRec warn that the job will fail)."""
    world_size = dist.get_world_size()
    return TopologyFactory.create_topology(
        TrainerConfig(world_size=world_size, local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size))),
        kernel_config=KernelConfig(compute_device=DEVICE.type),
    )


def shard(
    train_model: DLRMTrain,
    batch_size: int,
    learning_rate: float,
    print_plan: bool,
    seed: int = 0,
    registry: dict | None = None,
):
    """Plans with the stock planner and default sharders (:func:`build_sharders`: ``registry`` on
    the EmbeddingBagCollection's); returns (DMP model, combined optimizer).

    Every table starts from weights that depend on (seed, table, row) only, whatever the plan,
    so runs with different plans (stock or the plugin's) start alike and compare."""
    apply_optimizer_in_backward(
        torchrec.optim.RowWiseAdagrad,
        train_model.model.sparse_arch.parameters(),
        {"lr": learning_rate},
    )
    if print_plan:
        stats = logging.getLogger("torchrec.distributed.planner.stats")
        stats.setLevel(logging.INFO)
        stats.addHandler(logging.StreamHandler(sys.stdout))
        stats.propagate = False
    planner = EmbeddingShardingPlanner(
        topology=build_topology(),
        batch_size=batch_size,
        constraints=None,
    )
    sharders = build_sharders(registry)
    plan = planner.collective_plan(train_model, sharders, dist.GroupMember.WORLD)
    if print_plan and dist.get_rank() == 0:
        say(str(plan))
    tables = train_model.model.sparse_arch.embedding_bag_collection.embedding_bag_configs()
    model = DistributedModelParallel(module=train_model, device=DEVICE, plan=plan, sharders=sharders)
    init_tables_by_row(model, tables, seed)
    dense_optimizer = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda params: torch.optim.Adagrad(params, lr=learning_rate),
    )
    return model, CombinedOptimizer([model.fused_optimizer, dense_optimizer])


class PlainSteps:
    """Forward, backward and optimizer step, one batch at a time; ``progress`` as a pipeline's."""

    def __init__(self, model, optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def progress(self, batches: Iterator):
        self.optimizer.zero_grad()
        loss, output = self.model(next(batches))
        loss.backward()
        self.optimizer.step()
        return output

    def detach(self):
        return self.model


def train(args: argparse.Namespace, model, optimizer, source, step: int) -> int:
    """Trains from ``step`` to ``args.steps`` (checkpoints, loss lines, timing); returns the step reached."""
    rank = dist.get_rank()
    batches = (source.batch(at, rank, "train") for at in range(step, args.steps))
    if args.pipeline == "sparse_dist":
        pipeline = TrainPipelineSparseDist(model, optimizer, torch.device("cpu"))
    else:
        pipeline = PlainSteps(model, optimizer)
    first, started, saved_at = step, time.perf_counter(), step
    while step < args.steps:
        loss, _logits, _labels = pipeline.progress(batches)
        step += 1
        if rank == 0 and (step % args.log_every == 0 or step == args.steps):
            say(f"step {step} loss {float(loss):.4f}")
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            save_checkpoint(args.checkpoint_dir, step, model, optimizer)
            saved_at = step
    elapsed = time.perf_counter() - started
    pipeline.detach()  # the model's own forward again, for evaluation
    if rank == 0 and step > first:
        say(f"trained {step - first} steps in {elapsed:.1f} s ({(step - first) / elapsed:.2f} it/s)")
    if args.checkpoint_path is not None and saved_at != step:
        save_checkpoint(args.checkpoint_dir, step, model, optimizer)
    return step


@torch.no_grad()
def evaluate(model, source, eval_batches: int) -> float:
    """AUC over ``eval_batches`` held-out batches of every rank."""
    model.eval()
    scores, labels = [], []
    for index in range(eval_batches):
        _, (_, logits, label) = model(source.batch(index, dist.get_rank(), "eval"))
        scores.append(torch.sigmoid(logits.float()).reshape(-1))
        labels.append(label.float().reshape(-1))
    model.train()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (torch.cat(scores), torch.cat(labels)))
    return binary_auc(torch.cat([s for s, _ in gathered]), torch.cat([y for _, y in gathered]))


# ---- checkpoints -----------------------------------------------------------------------------


def checkpoint_state(model, optimizer, step: int) -> dict:
    """What a checkpoint holds; ``model.state_dict()`` also flushes anything a sharded module holds back."""
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": torch.tensor(step)}


def latest_checkpoint(directory: Path) -> tuple[int, Path] | None:
    """(step, dir) of the newest complete checkpoint under ``directory``, as rank 0 sees it."""
    found = None
    if dist.get_rank() == 0 and directory.is_dir():
        steps = [
            int(entry.name[len("step_") :])
            for entry in directory.iterdir()
            if entry.name.startswith("step_") and entry.name[len("step_") :].isdigit() and (entry / COMPLETE).exists()
        ]
        found = max(steps, default=None)
    shared = [found]
    dist.broadcast_object_list(shared, src=0)
    return None if shared[0] is None else (shared[0], directory / f"step_{shared[0]}")


def save_checkpoint(directory: Path, step: int, model, optimizer) -> None:
    """Saves ``<directory>/step_<step>/``; rank 0 marks it complete once every rank has written."""
    target = directory / f"step_{step}"
    if dist.get_rank() == 0 and target.exists():
        shutil.rmtree(target)  # left by an attempt that died while writing it
    dist.barrier()
    dcp.save(checkpoint_state(model, optimizer, step), checkpoint_id=str(target))
    dist.barrier()
    if dist.get_rank() == 0:
        (target / f"{COMPLETE}.tmp").write_text(f"{step}\n")
        os.replace(target / f"{COMPLETE}.tmp", target / COMPLETE)
        say(f"checkpoint step {step} saved {target}")


def load_checkpoint(target: Path, model, optimizer) -> int:
    """Loads a checkpoint into ``model`` and ``optimizer``; returns its step."""
    state = checkpoint_state(model, optimizer, 0)
    dcp.load(state, checkpoint_id=str(target))
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def save_weights(path: str, model) -> None:
    """Rank 0 writes every parameter unsharded (``torch.save`` of a name -> tensor dict)."""
    full = {}
    for name, value in model.state_dict().items():
        if _compat.is_sharded_tensor(value):  # every rank takes part
            out = torch.empty(value.size(), dtype=value.dtype) if dist.get_rank() == 0 else None
            value.gather(dst=0, out=out)
            value = out
        elif isinstance(value, DTensor):
            value = value.full_tensor()
        if dist.get_rank() == 0:
            full[name] = value.detach().clone()
    if dist.get_rank() == 0:
        with path_manager().open(path, "wb") as file:
            torch.save(full, file)


# ---- main ------------------------------------------------------------------------------------


def say(line: str) -> None:
    """One whole line to stdout (one write, so lines of ranks sharing a pipe never interleave)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def init_distributed(timeout_s: float | None = None) -> None:
    """gloo from torchrun's environment; a one-rank world when started with plain ``python``."""
    if "RANK" not in os.environ:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.environ.update(
            RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
        )
    dist.init_process_group("gloo", timeout=None if timeout_s is None else timedelta(seconds=timeout_s))


def restore(args: argparse.Namespace, model, optimizer) -> int:
    """Loads the newest complete checkpoint, if any (``--evaluate-only`` needs one); returns its step."""
    found = latest_checkpoint(args.checkpoint_dir)
    if found is None:
        if args.evaluate_only:
            raise SystemExit(f"--evaluate-only: no complete checkpoint under {args.checkpoint_path}")
        if dist.get_rank() == 0:
            say(f"no checkpoint under {args.checkpoint_path}; starting at step 0")
        return 0
    step = load_checkpoint(found[1], model, optimizer)
    if dist.get_rank() == 0:
        say(f"loaded checkpoint step {step} {found[1]}")
    return step


def finished_run(step: int, args: argparse.Namespace) -> str:
    """What a resume that finds the run finished says: it trains nothing, and how to start afresh."""
    return (
        f"resumed at step {step} of {args.steps}: trained nothing, the run under {args.checkpoint_path} is finished; "
        f"to start fresh leave out --resume (torchx: --resume False) or give another --checkpoint-path, "
        f"to train on pass --steps above {step}"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    init_distributed(args.pg_timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    say(f"worker rank {rank} pid {os.getpid()} attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    preset = PRESETS[args.preset]()
    batch_size = args.batch_size or preset.batch_size
    config = DataConfig(table_sizes=preset.table_sizes, batch_size=batch_size, alpha=args.alpha, seed=args.seed)
    source = open_source(args.data, config, world_size)
    torch.manual_seed(args.seed)
    train_model = build_model(preset, source.feature_names, source.num_dense)
    registry = codecs_registry(args.fwd_comm_precision, args.bwd_comm_precision, DEVICE)
    if registry is not None and rank == 0:
        say(f"qcomms {args.fwd_comm_precision}/{args.bwd_comm_precision} runs {describe_codecs(registry)}")
    model, optimizer = shard(train_model, batch_size, args.learning_rate, args.print_plan, args.seed, registry)

    step = restore(args, model, optimizer) if args.resume or args.evaluate_only else 0
    if args.resume and not args.evaluate_only and step >= args.steps and rank == 0:
        say(finished_run(step, args))
    if not args.evaluate_only:
        step = train(args, model, optimizer, source, step)

    auc = evaluate(model, source, args.eval_batches) if args.eval_batches else None
    if args.save_weights:
        save_weights(args.save_weights, model)
    if rank == 0:
        say(f"final step {step}" + (f" auc {auc:.4f}" if auc is not None else ""))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
