"""The DLRM recipe with a SIGKILL armed at one of the runtime's worst moments.

    python -m torchrec_het.launch --nproc-per-node 2 --max-restarts 1 \\
        -m torchrec_het_bench.testing.killed_recipe --steps 10 ...      # the recipe's own arguments

``$TORCHREC_HET_TESTING_KILL=POINT:RANK:STEP``: in the first attempt (torchrun's
``TORCHELASTIC_RESTART_COUNT`` 0), rank RANK kills itself with SIGKILL at the first POINT once
its STEP-th training step has begun, after printing ``kill point POINT rank RANK step S pid P``.
Points (each wraps a public method of the runtime from here, the harness; the runtime is unchanged):

- ``het_push``: a ``het_cached_row_wise`` backward has started its gradient push (HET's push, or
  an exact cache's fetched rows' gradients: the all-to-all to the rows' owners is in flight, not
  yet applied there);
- ``replica_sync``: a ``het_row_replicated`` replica sync has summed the replicated rows'
  gradients over the ranks, and this rank has not applied them;
- ``hybrid_update``: the hybrid pipeline's embedding update of a batch runs on its worker
  thread (while the main thread runs the next batch's dense forward), inside its gradient push;
- ``lookahead_early``: a ``het_row_replicated`` owner with lookahead has sent the next batch's
  partial sums early (in flight) and expects that batch's step, which has not happened.

Without the variable it is the recipe, unchanged.
"""

import os
import signal
import sys
import threading

from torchrec_het.sharding.common.exchange import Exchange
from torchrec_het.sharding.het_cache.pushes import HetPushes
from torchrec_het.sharding.row_replicated import lookup as replicated_lookup
from torchrec_het.sharding.row_replicated.sync import HostGroups
from torchrec_het_bench.recipes import train_dlrm

KILL_ENV = "TORCHREC_HET_TESTING_KILL"
POINTS = ("het_push", "replica_sync", "hybrid_update", "lookahead_early")
WORKER_THREAD = "embedding-backward"  # HybridTrainPipeline's worker thread name prefix


def parse_kill(text: str) -> tuple[str, int, int]:
    """``POINT:RANK:STEP`` -> (point, rank, step); a ValueError names the variable."""
    parts = text.split(":")
    if len(parts) != 3 or parts[0] not in POINTS or not parts[1].isdigit() or not parts[2].isdigit():
        raise ValueError(f"${KILL_ENV} must be POINT:RANK:STEP with POINT one of {POINTS}, got {text!r}")
    return parts[0], int(parts[1]), int(parts[2])


class KillSwitch:
    """Counts training steps begun and kills this process at the first armed point from ``step`` on."""

    def __init__(self, point: str, step: int) -> None:
        self.point, self.step, self.steps_begun = point, step, 0

    def step_begun(self) -> None:
        self.steps_begun += 1

    def reached(self, point: str) -> None:
        if point != self.point or self.steps_begun < self.step:
            return
        on_worker = threading.current_thread().name.startswith(WORKER_THREAD)
        if (point == "hybrid_update") != on_worker:
            return
        sys.stdout.write(
            f"kill point {point} rank {os.environ.get('RANK')} step {self.steps_begun} pid {os.getpid()}\n"
        )
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)


def arm(switch: KillSwitch) -> None:
    """Wraps the recipe's pipelines' ``progress`` (steps) and the runtime methods of the kill points."""
    # the recipe's TrainPipelineSparseDist: TorchRec's, or the hybrid pipeline the launcher installed
    for cls in (train_dlrm.TrainPipelineSparseDist, train_dlrm.PlainSteps):
        _wrap_progress(cls, switch)
    write_back = HetPushes.write_back

    def het_write_back(self, *args, **kwargs):
        write_back(self, *args, **kwargs)  # the push's all-to-all is started
        switch.reached("het_push")
        switch.reached("hybrid_update")

    HetPushes.write_back = het_write_back
    start_gradient = Exchange.start_gradient  # an exact cache's rows (the fetched-rows tier): their gradients

    def gradient_sent(self, *args, **kwargs):
        start_gradient(self, *args, **kwargs)  # the gradients' all-to-all is started
        switch.reached("het_push")
        switch.reached("hybrid_update")

    Exchange.start_gradient = gradient_sent
    _wrap_sync("all_reduce", HostGroups.all_reduce, switch)
    start_early = replicated_lookup.start_early_partials

    def early_sent(*args, **kwargs):
        early = start_early(*args, **kwargs)
        switch.reached("lookahead_early")
        return early

    replicated_lookup.start_early_partials = early_sent  # what the bag lookups call for each batch


def _wrap_progress(cls: type, switch: KillSwitch) -> None:
    progress = cls.progress  # its own or inherited; the wrapper is set on ``cls``

    def counted(self, *args, **kwargs):
        switch.step_begun()
        return progress(self, *args, **kwargs)

    cls.progress = counted


def _wrap_sync(name: str, method, switch: KillSwitch) -> None:
    def synced(self, *args, **kwargs):
        result = method(self, *args, **kwargs)
        if kwargs.get("async_op"):
            result.wait()  # the sum is complete
        switch.reached("replica_sync")
        return result

    setattr(HostGroups, name, synced)


def main(argv: list[str] | None = None) -> None:
    spec = os.environ.get(KILL_ENV, "").strip()
    if spec and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        point, rank, step = parse_kill(spec)
        if int(os.environ.get("RANK", "0")) == rank:
            arm(KillSwitch(point, step))
    train_dlrm.main(argv)


if __name__ == "__main__":
    main()
