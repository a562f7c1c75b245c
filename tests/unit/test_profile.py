"""Access profiles: counting, hottest rows, iopath round trip, clear errors on bad or mismatched files."""

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_het.replication import AccessProfile, count_accesses, load_profile, save_profile
from torchrec_het_bench.profile import main

TABLES = [
    EmbeddingBagConfig(name="t0", feature_names=["f0"], embedding_dim=4, num_embeddings=6),
    EmbeddingBagConfig(name="t1", feature_names=["f1", "f2"], embedding_dim=4, num_embeddings=4),
]


def _kjt(f0: list[int], f1: list[int], f2: list[int]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1", "f2"],
        values=torch.tensor(f0 + f1 + f2),
        lengths=torch.tensor([len(f0), 0, len(f1), 0, len(f2), 0]),
    )


def test_counts_every_sampled_batch() -> None:
    batches = [_kjt([1, 1, 5], [0], [0, 3]), _kjt([2], [1], []), _kjt([1], [3], [3])]
    profile = count_accesses(batches, TABLES)
    assert profile.batches == 3
    assert profile.table_counts("t0").tolist() == [0, 3, 1, 0, 0, 1]
    assert profile.table_counts("t1").tolist() == [2, 1, 0, 3]  # both features read t1
    assert profile.hottest("t1", 2).tolist() == [3, 0]
    assert profile.coverage("t0", 1) == pytest.approx(3 / 5)
    sampled = count_accesses(batches, TABLES, every=2)  # batches 0 and 2
    assert sampled.batches == 2 and sampled.table_counts("t0").tolist() == [0, 3, 0, 0, 0, 1]


def test_bad_batches_name_the_feature() -> None:
    with pytest.raises(ValueError, match="feature 'f0': ids outside table 't0'"):
        count_accesses([_kjt([6], [], [])], TABLES)
    missing = KeyedJaggedTensor.from_lengths_sync(keys=["f0"], values=torch.tensor([1]), lengths=torch.tensor([1]))
    with pytest.raises(ValueError, match="feature 'f1' of table 't1' is missing"):
        count_accesses([missing], TABLES)
    with pytest.raises(ValueError, match="every"):
        count_accesses([], TABLES, every=0)


def test_round_trip_and_checks(tmp_path) -> None:
    profile = count_accesses([_kjt([1, 2], [0], [3])], TABLES)
    path = str(tmp_path / "p.pt")
    save_profile(profile, path)
    loaded = load_profile(path, TABLES)
    assert loaded.tables == ("t0", "t1") and loaded.batches == 1
    assert all(torch.equal(a, b) for a, b in zip(loaded.counts, profile.counts))
    other = [EmbeddingBagConfig(name="t0", feature_names=["f0"], embedding_dim=4, num_embeddings=7), TABLES[1]]
    with pytest.raises(ValueError, match="table 't0' has 6 rows in the profile but 7 in the model"):
        load_profile(path, other)
    with pytest.raises(ValueError, match="profile has no table 't2'"):
        load_profile(
            path, TABLES + [EmbeddingBagConfig(name="t2", feature_names=["f3"], embedding_dim=4, num_embeddings=2)]
        )
    with pytest.raises(ValueError, match=r"profile has table\(s\) \['t1'\] that the model does not have"):
        load_profile(path, TABLES[:1])


def test_corrupt_and_foreign_files(tmp_path) -> None:
    path = tmp_path / "p.pt"
    save_profile(count_accesses([_kjt([1], [0], [0])], TABLES), str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable torchrec_het profile"):
        load_profile(str(path))
    torch.save({"format": "something else"}, path)
    with pytest.raises(ValueError, match="not a torchrec_het profile"):
        load_profile(str(path))
    torch.save({"format": "torchrec_het.profile", "version": 99}, path)
    with pytest.raises(ValueError, match="version 99"):
        load_profile(str(path))
    torch.save(
        {
            "format": "torchrec_het.profile",
            "version": 1,
            "tables": ["t0"],
            "num_rows": [6],
            "counts": [torch.zeros(5, dtype=torch.int64)],
            "batches": 1,
        },
        path,
    )
    with pytest.raises(ValueError, match="corrupt profile.*'t0'"):
        load_profile(str(path))
    with pytest.raises(FileNotFoundError):
        load_profile(str(tmp_path / "missing.pt"))


def test_a_missing_profile_names_the_path_and_how_to_make_one(tmp_path) -> None:
    from torchrec_het.errors import ConfigurationError

    missing = str(tmp_path / "missing.pt")
    with pytest.raises(ConfigurationError) as raised:  # the launcher ends the job on it with its one line
        load_profile(missing)
    message = str(raised.value)
    assert message.startswith(f"{missing}: no access profile there") and "AccessProfiler" in message, message
    assert f"python -m torchrec_het_bench.profile --preset smoke --out {missing}" in message, message
    assert isinstance(raised.value, FileNotFoundError) and raised.value.__suppress_context__  # no iopath traceback


def test_profile_validates_itself() -> None:
    with pytest.raises(ValueError, match="one entry per table"):
        AccessProfile(("a",), (2, 3), (torch.zeros(2, dtype=torch.int64),), 1)


def test_command_writes_a_loadable_profile(tmp_path, capsys) -> None:
    out = str(tmp_path / "smoke.pt")
    assert main(["--preset", "smoke", "--steps", "40", "--every", "20", "--out", out]) == 0
    assert "profiled 2 of 40 batches (26 tables)" in capsys.readouterr().out
    profile = load_profile(out)
    assert profile.batches == 2 and len(profile.tables) == 26
    assert sum(int(c.sum()) for c in profile.counts) == 2 * 256 * 26  # smoke: batch 256, one id per bag


@pytest.mark.parametrize("flag,value", [("--steps", "-1"), ("--steps", "0"), ("--every", "0")])
def test_command_rejects_an_empty_sample(tmp_path, capsys, flag: str, value: str) -> None:
    out = tmp_path / "p.pt"
    with pytest.raises(SystemExit) as raised:
        main(["--preset", "smoke", flag, value, "--out", str(out)])
    assert raised.value.code == 2 and f"{flag} must be >= 1, got {value}" in capsys.readouterr().err
    assert not out.exists()


def test_profiler_counts_your_own_batches_and_saves_a_loadable_profile(tmp_path) -> None:
    from torchrec import EmbeddingBagCollection

    from torchrec_het.replication import AccessProfiler
    from torchrec_het_bench.profile import AccessProfiler as from_command_module

    assert from_command_module is AccessProfiler
    ebc = EmbeddingBagCollection(tables=TABLES, device=torch.device("meta"))
    profiler = AccessProfiler.for_model(ebc)
    path = str(tmp_path / "mine.pt")
    with pytest.raises(ValueError, match="no batch observed"):
        profiler.save(path)
    batches = [_kjt([1, 1, 5], [0], [0, 3]), _kjt([2], [1], []), _kjt([1], [3], [3])]
    for batch in batches:
        profiler.observe(batch)
    saved = profiler.save(path)
    loaded = load_profile(path, TABLES)
    expected = count_accesses(batches, TABLES)
    assert saved.batches == loaded.batches == 3
    assert all(torch.equal(a, b) for a, b in zip(loaded.counts, expected.counts))
    assert loaded.table_counts("t0").tolist() == [0, 3, 1, 0, 0, 1]
    with pytest.raises(ValueError, match="feature 'f0': ids outside table 't0'"):
        profiler.observe(_kjt([6], [], []))
