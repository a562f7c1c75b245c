"""The benchmark's soak mode: a quick soak (2 ranks, smoke preset, a few hundred steps) of each plugin type
under TorchRec's TrainPipelineSparseDist and the hybrid pipeline finds live objects flat after warm-up, so
a leak like a3e5023's (every het_row_replicated step kept its output dist's graph: 7 tensors a step) fails
here; and the verdict, the flags and the page, each on its own.
"""

import json

import pytest

from torchrec_het_bench import __main__ as bench_main
from torchrec_het_bench import docs, launch
from torchrec_het_bench.soak import SoakSpec
from torchrec_het_bench.soak_results import LIVE_SLACK, markdown_table, slope_per_1k_steps, verdict
from torchrec_het_testing.bench_runs import run_smoke_bench

CONFIGS = ["het_het_s10_c1", "rep_m100_s1"]  # het_cached_row_wise, het_row_replicated
ENTRIES = [f"{config}@{pipeline}" for config in CONFIGS for pipeline in ("sparse_dist", "hybrid_k2")]
STEPS, WARMUP, EVERY = 200, 50, 50


@pytest.fixture(scope="module")
def soaked(tmp_path_factory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("soak")
    results, run = run_smoke_bench(
        out, CONFIGS, "--soak", str(STEPS), "--warmup-steps", str(WARMUP), "--soak-every", str(EVERY),
        "--pipeline", "sparse_dist,hybrid", timeout=600,
    )  # fmt: skip
    assert (out / "soak.png").stat().st_size > 0
    return results, run.stdout


def test_live_objects_stay_flat_after_warm_up_for_each_plugin_type_and_the_hybrid_pipeline(soaked) -> None:
    results, _ = soaked
    assert [c["name"] for c in results["configs"]] == ENTRIES
    for entry in results["configs"]:
        assert "not_run" not in entry, entry.get("not_run")
        live = entry["verdict"]["live_tensors"]
        grown = entry["grown_types"][0]
        assert live["flat"], f"{entry['name']}: live tensors {live}; grown most: {grown}"
        assert entry["verdict"]["gc_objects"]["flat"], (
            f"{entry['name']}: gc objects {entry['verdict']['gc_objects']}; {grown}"
        )
        assert max(live["end"]) - min(live["warmup"]) <= LIVE_SLACK["live_tensors"], (entry["name"], live)


def test_the_series_are_sampled_per_rank_and_the_table_is_printed(soaked) -> None:
    results, stdout = soaked
    assert results["mode"] == "soak" and results["preset"] == "smoke"
    assert results["soak"] == {**results["soak"], "steps": STEPS, "warmup_steps": WARMUP, "sample_every": EVERY}
    sampled = list(range(EVERY, STEPS + 1, EVERY))
    for entry in results["configs"]:
        assert len(entry["series"]) == 2 and entry["peak_reset"] == [True, True]
        for rank in entry["series"]:
            assert rank["step"] == sampled
            counted = [n is not None for n in rank["live_tensors"]]
            assert counted == [step >= WARMUP for step in sampled]  # counted from the end of the warm-up on
            assert all(peak >= rss > 0 for peak, rss in zip(rank["peak_rss_mb"], rank["rss_mb"]))
            assert all(s > 0 for s in rank["seconds"]) and all(0 < loss < 1 for loss in rank["loss"])
        assert entry["sharding_types"] == [entry["params"]["sharding"]]
        assert f"| {entry['name']} |" in stdout
    assert "peak RSS growth %" in stdout


def _series(tensors: list[int], peaks: list[float], steps: list[int]) -> list[dict]:
    return [
        {
            "step": steps,
            "peak_rss_mb": peaks,
            "live_tensors": tensors,
            "gc_objects": [None if n is None else 10_000 + n for n in tensors],
        }
    ]


def test_the_verdict_fails_a_steady_leak_and_passes_a_first_time_bump() -> None:
    soak = SoakSpec(steps=200, warmup_steps=50, sample_every=25)
    steps = [25, 50, 75, 100, 125, 150, 175, 200]
    leaking = verdict(_series([None, 100, 275, 450, 625, 800, 975, 1150], [400.0] * 8, steps), soak)
    assert not leaking["live_tensors"]["flat"] and not leaking["live_flat"] and not leaking["holds"]
    assert leaking["live_tensors"]["per_1k_steps"] == [7000.0]
    assert (leaking["live_tensors"]["warmup"], leaking["live_tensors"]["midpoint"], leaking["live_tensors"]["end"]) == (
        [100],
        [625],
        [1150],
    )
    bump = verdict(_series([None, 100, 180, 180, 180, 180, 181, 181], [400.0] * 8, steps), soak)
    assert bump["live_flat"] and bump["holds"]
    grown = verdict(_series([None, 100] + [100] * 6, [390.0, 400.0, 410, 415, 420, 421, 421, 421], steps), soak)
    assert grown["peak_rss_growth_pct"] == [5.25] and not grown["rss_within_limit"] and grown["live_flat"]
    assert "heap_in_use_mb" not in grown  # no allocator figures recorded (not glibc)
    kept = _series([None, 100] + [100] * 6, [390.0, 400.0, 410, 415, 420, 421, 421, 421], steps)
    kept[0].update(heap_in_use_mb=[150.0] * 8, heap_free_mb=[40.0, 50, 60, 65, 70, 71, 71, 71])
    assert verdict(kept, soak)["heap_free_mb"] == {"warmup": [50], "end": [71]}
    assert verdict(kept, soak)["heap_in_use_mb"] == {"warmup": [150.0], "end": [150.0]}


def test_slope_is_per_thousand_steps() -> None:
    assert slope_per_1k_steps([0, 100, 200], [5, 6, 7]) == pytest.approx(10.0)
    assert slope_per_1k_steps([100], [5]) == 0.0


def test_the_soak_defaults_and_its_sample_points() -> None:
    soak = SoakSpec.of(3000)
    assert (soak.warmup_steps, soak.sample_every) == (600, 75)
    assert [s for s in range(1, 3001) if soak.sampled(s)][:9] == [75, 150, 225, 300, 375, 450, 525, 600, 675]
    odd = SoakSpec(steps=100, warmup_steps=30, sample_every=40)
    assert [s for s in range(1, 101) if odd.sampled(s)] == [30, 40, 80, 100]
    assert odd.next_sample(40) == 80 and odd.next_sample(80) == 100


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--soak-every", "5"], "argument --soak-every: only with --soak"),
        (["--soak", "100", "--rounds", "3"], "argument --rounds: not with --soak"),
        (["--soak", "100", "--eval-every", "10"], "argument --eval-every: not with --soak"),
        (["--soak", "100", "--warmup-steps", "100"], "argument --warmup-steps: soak: warm-up must be >= 1 and below"),
        (["--soak", "1"], "argument --soak: must be an int >= 2"),
    ],
)
def test_bad_soak_flags_are_refused_naming_the_flag(argv, message, capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("ranks were spawned"))
    monkeypatch.setattr(bench_main, "spawn", lambda *a, **k: pytest.fail("ranks were spawned"))
    with pytest.raises(SystemExit) as exited:
        bench_main.main(["--preset", "smoke", "--out", str(tmp_path), *argv])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_the_page_renders_a_soak_run(soaked, tmp_path) -> None:
    results, _ = soaked
    path = tmp_path / "09_soak.json"
    path.write_text(json.dumps(results))
    out = tmp_path / "bench.md"
    assert docs.main([str(path), "--out", str(out)]) == 0
    text = (tmp_path / docs.HISTORY).read_text()  # the claims page links the runs page
    assert "## 09_soak\n" in text and "### Memory over the run" in text
    assert f"command: `python -m torchrec_het_bench --soak {STEPS} --warmup-steps {WARMUP} --soak-every {EVERY}" in text
    assert markdown_table(results).rstrip("\n") in text
