"""Bad number flags of the benchmark and its microbenchmark are refused in the parent, before any
rank is spawned: exit code 2 and a message naming the flag and the allowed range."""

import pytest

from torchrec_het_bench import __main__ as bench_main
from torchrec_het_bench import launch, micro


@pytest.fixture(autouse=True)
def no_spawn(monkeypatch):
    """A flag that got through would start ranks: fail at once instead."""

    def refuse(*args, **kwargs):
        raise AssertionError("ranks were spawned")

    monkeypatch.setattr(bench_main, "spawn", refuse)
    monkeypatch.setattr(micro, "spawn", refuse)
    monkeypatch.setattr(launch, "spawn", refuse)


def _refused(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err


BENCH_BAD = [
    ("--alpha", "-1", ">= 0"),
    ("--alpha", "nan", ">= 0"),
    ("--warmup-steps", "-3", ">= 0"),
    ("--steps-per-round", "0", ">= 1"),
    ("--rounds", "2", ">= 3"),
    ("--world-size", "0", ">= 1"),
    ("--hosts", "0", ">= 1"),
    ("--gbit", "0", "> 0"),
    ("--gbit", "inf", "> 0"),
    ("--delay-ms", "-0.5", ">= 0"),
    ("--eval-every", "-1", ">= 0"),
    ("--embedding-staleness", "-2", ">= 0"),
    ("--seed", "-1", ">= 0"),
    ("--rounds", "three", ">= 3"),
]


@pytest.mark.parametrize("flag, value, rule", BENCH_BAD)
def test_bench_refuses_a_bad_number_naming_the_flag(flag, value, rule, capsys, tmp_path) -> None:
    err = _refused(bench_main.main, ["--preset", "smoke", "--out", str(tmp_path), flag, value], capsys)
    assert f"argument {flag}:" in err and rule in err and repr(value) in err


def test_bench_refuses_ranks_that_do_not_fill_the_emulated_hosts(capsys, tmp_path) -> None:
    argv = ["--preset", "smoke", "--out", str(tmp_path), "--network", "emulated", "--world-size", "3", "--hosts", "2"]
    err = _refused(bench_main.main, argv, capsys)
    assert "--world-size 3 is not a multiple of --hosts 2" in err


def test_bench_accepts_the_edges_of_each_range() -> None:
    args = bench_main.parse_args(
        [
            "--alpha",
            "0",
            "--warmup-steps",
            "0",
            "--steps-per-round",
            "1",
            "--rounds",
            "3",
            "--world-size",
            "1",
            "--delay-ms",
            "0",
            "--eval-every",
            "0",
            "--embedding-staleness",
            "0",
            "--seed",
            "0",
            "--gbit",
            "0.5",
        ]
    )
    assert (args.alpha, args.warmup_steps, args.rounds, args.world_size, args.gbit) == (0.0, 0, 3, 1, 0.5)


@pytest.mark.parametrize(
    "flag, value, rule",
    [
        ("--warmup-steps", "-3", ">= 0"),
        ("--steps-per-round", "0", ">= 1"),
        ("--rounds", "1", ">= 3"),
        ("--world-size", "1", ">= 2"),
        ("--seed", "-1", ">= 0"),
    ],
)
def test_micro_refuses_a_bad_number_naming_the_flag(flag, value, rule, capsys, tmp_path) -> None:
    err = _refused(micro.main, ["--preset", "smoke", "--out", str(tmp_path), flag, value], capsys)
    assert f"argument {flag}:" in err and rule in err


def test_micro_refuses_an_unknown_type(capsys, tmp_path) -> None:
    err = _refused(micro.main, ["--preset", "smoke", "--out", str(tmp_path), "--types", "nope"], capsys)
    assert "--types" in err and "nope" in err


@pytest.mark.parametrize(
    "flag, value, valid",
    [
        ("--configs", "stock_table_wise,nope", "stock_row_wise"),
        ("--configs", "het_het_s2_c1,het_het_s2_c1", "configuration named twice"),
        ("--pipeline", "sparse_dist,nope", "'semi_sync'"),
        ("--pipeline", "hybrid,hybrid", "names a pipeline twice"),
    ],
)
def test_bench_refuses_an_unknown_name_naming_the_flag_and_the_valid_ones(flag, value, valid, capsys, tmp_path) -> None:
    err = _refused(bench_main.main, ["--preset", "smoke", "--out", str(tmp_path), flag, value], capsys)
    last = err.strip().splitlines()[-1]
    assert last.startswith("torchrec-het-bench: error:") and flag in last and valid in last
    if "nope" in value:
        assert "nope" in last


def test_bench_refuses_a_configuration_the_preset_does_not_run(capsys, tmp_path) -> None:
    err = _refused(bench_main.main, ["--preset", "full", "--out", str(tmp_path), "--configs", "stock_dp_small"], capsys)
    last = err.strip().splitlines()[-1]
    assert "argument --configs: configuration(s) stock_dp_small do not apply to preset 'full'" in last
    assert "stock_table_wise" in last  # what it runs instead


def test_bench_list_ignores_the_configs_flag(capsys) -> None:
    assert bench_main.main(["--preset", "smoke", "--list", "--configs", "nope"]) == 0
    assert "stock_dp_small" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flag, value, rule",
    [
        ("--alpha", "-1", ">= 0"),
        ("--alpha", "nan", ">= 0"),
        ("--seed", "-1", ">= 0"),
        ("--steps", "0", ">= 1"),
        ("--every", "0", ">= 1"),
        ("--world-size", "0", ">= 1"),
        ("--rank", "2", "--rank must lie in [0, --world-size 2)"),
    ],
)
def test_profile_refuses_a_bad_flag_naming_it(flag, value, rule, capsys, tmp_path) -> None:
    from torchrec_het_bench import profile

    err = _refused(profile.main, ["--preset", "smoke", "--out", str(tmp_path / "p.pt"), flag, value], capsys)
    assert flag in err and rule in err and not (tmp_path / "p.pt").exists()
