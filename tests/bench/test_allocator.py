"""The benchmark ranks' steady allocator: glibc's thresholds fixed unless the user set them."""

import platform

import pytest

from torchrec_het_bench import allocator


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_the_thresholds_are_fixed_on_glibc() -> None:
    assert allocator.steady_allocator_available()
    assert allocator.hold_allocator_steady()


def test_a_users_own_threshold_is_kept(monkeypatch) -> None:
    monkeypatch.setenv(allocator.ENV, "1048576")
    assert not allocator.steady_allocator_available()
    assert not allocator.hold_allocator_steady()
