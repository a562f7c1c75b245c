"""The benchmark's training loops and step-time clock, in one process (nothing is spawned)."""

import pytest
import torch

from torchrec_het_bench import step_time
from torchrec_het_bench.__main__ import main
from torchrec_het_bench.pipelines import (
    DEFAULT_EMBEDDING_STALENESS,
    DEFAULT_PIPELINE,
    PIPELINES,
    BatchFeed,
    PipelineRefused,
    PipelineUnavailable,
    TorchRecLoop,
    check_pipeline,
    entry_name,
    parse_pipelines,
)
from torchrec_het_bench.report import step_time_table
from torchrec_het_bench.step_time import STEP_PARTS, StepClock

CPU = torch.device("cpu")


def test_sparse_dist_is_the_default_and_runs_on_cpu():
    assert DEFAULT_PIPELINE == "sparse_dist"
    assert check_pipeline("sparse_dist", CPU).lookahead == 2
    assert check_pipeline("plain", CPU).lookahead == 0


def test_hybrid_and_semi_sync_run_on_cpu_with_their_staleness_and_lookahead():
    assert DEFAULT_EMBEDDING_STALENESS == 2
    runs = parse_pipelines(" sparse_dist, hybrid ,semi_sync,plain", 3, CPU)
    assert [r.name for r in runs] == ["sparse_dist", "hybrid", "semi_sync", "plain"]
    assert [r.label for r in runs] == ["sparse_dist", "hybrid_k3", "semi_sync", "plain"]
    # k is --embedding-staleness for hybrid only; the others' by design (semi-sync reads at B-2: one update missed)
    assert [r.embedding_staleness for r in runs] == [0, 3, 1, 0]
    assert [r.lookahead for r in runs] == [2, 5, 3, 0]  # hybrid holds k + 2 batches beyond the one it trains
    assert "CPU adapter" in PIPELINES["semi_sync"].description
    assert entry_name("stock_table_wise", runs[1], several=True) == "stock_table_wise@hybrid_k3"
    assert entry_name("stock_table_wise", runs[1], several=False) == "stock_table_wise"


@pytest.mark.parametrize(
    "text, k, message",
    [
        ("sparse_dist,sparse_dist", 2, "--pipeline names a pipeline twice"),
        (" , ", 2, "--pipeline names no pipeline"),
        ("sparse_dist,nope", 2, "unknown pipeline 'nope'"),
        ("hybrid", -1, "--embedding-staleness must be an int >= 0, got -1"),
        ("sparse_dist", True, "--embedding-staleness must be an int >= 0, got True"),
    ],
)
def test_bad_pipeline_lists_and_staleness_are_refused(text, k, message):
    with pytest.raises(PipelineUnavailable, match=message):
        parse_pipelines(text, k, CPU)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--embedding-staleness", "-1"], "argument --embedding-staleness: must be an int >= 0, got '-1'"),
        (["--embedding-staleness", "two"], "argument --embedding-staleness: must be an int >= 0, got 'two'"),
        (["--eval-every", "-5"], "argument --eval-every: must be an int >= 0, got '-5'"),
    ],
)
def test_the_command_line_checks_the_staleness_and_evaluation_flags_before_any_rank(argv, message, capsys):
    with pytest.raises(SystemExit) as caught:
        main(["--preset", "smoke", "--configs", "stock_table_wise", "--pipeline", "hybrid", "--no-progress", *argv])
    assert caught.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


def test_the_command_line_refuses_a_repeated_pipeline_before_any_rank(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["--preset", "smoke", "--configs", "stock_table_wise", "--pipeline", "hybrid,hybrid", "--no-progress"])
    assert caught.value.code == 2  # argparse's usage error
    captured = capsys.readouterr()
    assert captured.err.splitlines()[-1].endswith("error: --pipeline names a pipeline twice: hybrid,hybrid")
    assert captured.out == ""


@pytest.mark.parametrize("name, reason", [("prefetch_sparse_dist", "Invalid PrefetchPipelinedForward usage")])
def test_a_pipeline_the_device_cannot_run_is_refused_in_one_clear_line(name, reason):
    with pytest.raises(PipelineUnavailable) as caught:
        check_pipeline(name, CPU)
    message = str(caught.value)
    assert "\n" not in message
    assert f"--pipeline {name} cannot run on this device (cpu)" in message and reason in message
    assert "sparse_dist" in message  # what to use instead
    assert check_pipeline(name, torch.device("cuda")) is PIPELINES[name]  # a device that can run it may


def test_pec_is_offered_for_cuda_where_the_installed_torchrec_has_it():
    from torchrec_het import _compat

    if _compat.pec_train_pipeline_class() is None:  # TorchRec 1.8: no TrainPipelinePEC
        for device in (CPU, torch.device("cuda")):
            with pytest.raises(
                PipelineUnavailable,
                match=r"--pipeline pec cannot run here: TrainPipelinePEC is new in "
                r"TorchRec 1\.9; torchrec 1\.8\.0 is installed",
            ):
                check_pipeline("pec", device)
    else:
        with pytest.raises(
            PipelineUnavailable, match=r"--pipeline pec cannot run on this device \(cpu\): .*NVIDIA driver"
        ):
            check_pipeline("pec", CPU)
        assert check_pipeline("pec", torch.device("cuda")) is PIPELINES["pec"]


def test_the_command_line_refuses_before_starting_any_rank(capsys):
    with pytest.raises(SystemExit) as caught:
        main(
            [
                "--preset",
                "smoke",
                "--configs",
                "stock_table_wise",
                "--pipeline",
                "sparse_dist,prefetch_sparse_dist",
                "--no-progress",
            ]
        )
    assert caught.value.code == 2
    captured = capsys.readouterr()
    assert "error: --pipeline prefetch_sparse_dist cannot run on this device (cpu)" in captured.err.splitlines()[-1]
    assert captured.out == ""  # nothing ran


def test_unknown_pipeline():
    with pytest.raises(PipelineUnavailable, match="unknown pipeline 'nope'"):
        check_pipeline("nope", CPU)


def test_a_torchrec_loop_refuses_to_run_on_an_empty_feed():
    class Pipeline:
        def __init__(self, model, optimizer, device):
            self.calls = 0

        def progress(self, feed):
            self.calls += 1
            return next(feed)

    sharded = type("Sharded", (), {"model": None, "optimizer": None})()
    feed = BatchFeed()
    feed.extend([(torch.tensor(0.5), None, None)])
    loop = TorchRecLoop(Pipeline, sharded, feed, CPU)
    assert loop.step() == 0.5
    with pytest.raises(RuntimeError, match="feed ran dry"):
        loop.step()  # a TorchRec pipeline would mark the iterator exhausted for good
    assert loop.pipeline.calls == 1
    feed.close()  # the end of the data: running dry is now the pipeline's business (it drains)
    with pytest.raises(StopIteration):
        loop.step()
    assert loop.pipeline.calls == 2
    with pytest.raises(RuntimeError, match="closed"):
        feed.extend([])


def test_a_pipeline_that_refuses_the_model_at_its_first_step_leaves_the_entry_not_run():
    class Pipeline:
        def __init__(self, model, optimizer, device):
            self.calls = 0

        def progress(self, feed):
            self.calls += 1
            next(feed)
            if self.calls in (1, 3):
                raise ValueError("Pipeline: this model has\n  tables it cannot train")
            return torch.tensor(0.25), None, None

    sharded = type("Sharded", (), {"model": None, "optimizer": None})()
    feed = BatchFeed()
    feed.extend(range(5))
    with pytest.raises(PipelineRefused) as caught:
        TorchRecLoop(Pipeline, sharded, feed, CPU).step()
    assert str(caught.value) == "Pipeline: this model has tables it cannot train"  # one line
    loop = TorchRecLoop(Pipeline, sharded, feed, CPU)
    loop.pipeline.calls = 1  # its first step passes; a ValueError later is an error, not a refusal
    assert loop.step() == 0.25
    with pytest.raises(ValueError):
        loop.step()
    assert loop.staleness_gauge() is None  # no gauge on this pipeline


class _FakeTime:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_clock_parts_are_exclusive_and_add_up_to_the_total(monkeypatch):
    fake = _FakeTime()
    monkeypatch.setattr(step_time.time, "perf_counter", fake.perf_counter)
    clock = StepClock()
    clock.start()  # t = 0
    fake.now = 1.0
    clock.enter("emb_fwd")
    fake.now = 3.0
    clock.enter("comm_wait")  # a wait inside the embedding forward: comm_wait only
    fake.now = 6.0
    clock.leave()
    fake.now = 7.0
    clock.leave()
    fake.now = 8.0
    clock.enter("emb_bwd")
    clock.enter("emb_bwd")  # the same part twice (nested hooks) counts once
    fake.now = 9.5
    clock.leave()
    clock.leave()
    fake.now = 10.0
    parts = clock.stop()
    assert parts == {"emb_fwd": 3.0, "comm_wait": 3.0, "emb_bwd": 1.5, "dense": 2.5, "total": 10.0}
    assert set(parts) == set(STEP_PARTS)


def test_clock_closes_a_region_an_exception_left_open_and_ignores_other_steps(monkeypatch):
    fake = _FakeTime()
    monkeypatch.setattr(step_time.time, "perf_counter", fake.perf_counter)
    clock = StepClock()
    with clock.region("emb_fwd"):  # not running: nothing is recorded
        fake.now = 5.0
    clock.start()
    with pytest.raises(ValueError):
        with clock.region("comm_wait"):
            fake.now = 7.0
            raise ValueError
    clock.enter("emb_fwd")  # left open
    fake.now = 9.0
    parts = clock.stop()
    assert parts == {"emb_fwd": 2.0, "emb_bwd": 0.0, "comm_wait": 2.0, "dense": 0.0, "total": 4.0}
    assert not clock.running


class _TickingTime:
    """Every reading is one second after the previous one."""

    def __init__(self):
        self.readings = 0

    def perf_counter(self):
        self.readings += 1
        return float(self.readings)


def _done_work():
    from torch._C._distributed_c10d import _create_work_from_future

    future = torch.futures.Future()
    future.set_result([torch.zeros(1)])
    return _create_work_from_future(future)


def test_installed_waits_count_as_comm_wait_and_emb_fwd_only_while_a_step_runs(monkeypatch):
    from torch.distributed.distributed_c10d import Work
    from torchrec.distributed.types import Awaitable, NoWait

    ticking = _TickingTime()
    monkeypatch.setattr(step_time.time, "perf_counter", ticking.perf_counter)
    work, awaitable = _done_work(), NoWait(3)
    originals = Work.wait, Awaitable.wait
    with step_time.timing_installed() as clock:
        work.wait()
        assert awaitable.wait() == 3
        assert ticking.readings == 0  # no step running: the patched waits do not touch the clock
        clock.start()  # reading 1
        work.wait()  # readings 2, 3: one second of comm_wait
        awaitable.wait()  # readings 4, 5: one second of emb_fwd
        parts = clock.stop()  # reading 6
    assert parts == {"emb_fwd": 1.0, "emb_bwd": 0.0, "comm_wait": 1.0, "dense": 3.0, "total": 5.0}
    assert (Work.wait, Awaitable.wait) == originals


def test_step_time_table_has_a_row_per_configuration():
    ms = dict.fromkeys(STEP_PARTS, 1.0)
    results = {
        "pipeline": "sparse_dist",
        "configs": [
            {"name": "a", "workload": "dlrm", "step_ms": ms},
            {"name": "c", "workload": "dlrm", "not_run": "refused"},
            {"name": "b", "workload": "sequence"},
        ],
    }
    rows = [line for line in step_time_table(results) if line.startswith("|")]
    assert rows[0] == "| workload | config | emb fwd | emb bwd | dense | comm wait | total |"
    assert rows[2] == "| dlrm | a | 1.00 | 1.00 | 1.00 | 1.00 | 1.00 |"
    assert rows[3] == "| sequence | b | - | - | - | - | - |"
    assert len(rows) == 4  # an entry that did not run has no row


class _ShortSource:
    """Batches are their step numbers; the data ends before step ``end``."""

    def __init__(self, end: int):
        self.end = end

    def batch(self, step: int, rank: int, split: str = "train"):
        from torchrec_het_bench.data import DataExhaustedError

        if step >= self.end:
            raise DataExhaustedError(f"no step {step}")
        return step


def test_the_feed_holds_a_round_ahead_and_closes_at_the_end_of_the_data(monkeypatch):
    from torchrec_het_bench import worker
    from torchrec_het_bench.presets import get_preset

    monkeypatch.setattr(worker.dist, "get_rank", lambda: 0)
    preset = get_preset("smoke")  # 3 warm-up steps, 3 rounds of 5
    spec = worker.RunSpec(preset, ("stock_table_wise",), 1, (0,), {"mode": "loopback"})
    (entry,) = spec.entries()
    total = preset.total_steps
    rounds = worker._RoundBatches(spec, {"dlrm": _ShortSource(end=total + 1)}, lookahead=2)
    assert rounds.get("dlrm", 0) == list(range(3, 8))
    assert rounds.get("dlrm", preset.rounds) == [total]  # the tail stops where the data does
    trainee = worker._Trainee(entry, sharded=None, feed=BatchFeed(), loop=None)
    worker._top_up(trainee, rounds, spec, steps=5, lookahead=2)
    assert list(trainee.feed._queue) == list(range(3, 13)) and not trainee.feed.closed  # rounds 0 and 1
    for _ in range(10):
        next(trainee.feed)
    worker._top_up(trainee, rounds, spec, steps=5, lookahead=2)
    assert list(trainee.feed._queue) == [*range(13, 18), total] and trainee.feed.closed
    short = worker._RoundBatches(spec, {"dlrm": _ShortSource(end=total - 1)}, lookahead=2)
    with pytest.raises(IndexError):  # a measured round past the data is an error, not a short round
        short.get("dlrm", preset.rounds - 1)


def test_backward_nodes_of_the_embedding_output_count_as_emb_bwd_for_their_step_only(monkeypatch):
    ticking = _TickingTime()
    monkeypatch.setattr(step_time.time, "perf_counter", ticking.perf_counter)
    weight = torch.ones(3, requires_grad=True)
    clock = step_time.CLOCK
    clock.start()  # reading 1
    pooled = weight * 2  # MulBackward0 -> AccumulateGrad(weight)
    accumulate = pooled.grad_fn.next_functions[0][0]  # kept alive across steps, as DDP does
    step_time._time_backward_of({"feature": pooled})
    pooled.sum().backward()  # the sum's node is not the embedding's; two hooked nodes: readings 2..5
    assert clock.stop() == {"emb_fwd": 0.0, "emb_bwd": 2.0, "comm_wait": 0.0, "dense": 3.0, "total": 5.0}
    clock.start()  # the next step reaches the same accumulator through a graph no one hooked
    (weight * 3).sum().backward()
    parts = clock.stop()
    assert parts["emb_bwd"] == 0.0 and parts["total"] == 1.0, parts
    assert accumulate is not None
