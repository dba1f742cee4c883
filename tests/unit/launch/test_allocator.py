"""The workers' malloc: which library the launcher preloads, and when it leaves the environment alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard.errors import OptionError
from trainyard.launch import allocator


@pytest.fixture
def libs(tmp_path: Path) -> tuple[str, ...]:
    """A library folder holding jemalloc and tcmalloc files (their names are all the launcher looks at)."""
    for file in ("libjemalloc.so.2", "libtcmalloc_minimal.so.4"):
        (tmp_path / file).write_bytes(b"")
    return (str(tmp_path),)


def test_the_preferred_library_is_preloaded_where_present(libs: tuple[str, ...]) -> None:
    assert allocator.preload_env({}, libs) == {"LD_PRELOAD": f"{libs[0]}/libjemalloc.so.2"}
    got = allocator.preload_env({allocator.SWITCH_ENV: "tcmalloc"}, libs)
    assert got == {"LD_PRELOAD": f"{libs[0]}/libtcmalloc_minimal.so.4"}


def test_nothing_is_preloaded_when_switched_off_absent_or_the_user_preloads(libs: tuple[str, ...],
                                                                            tmp_path: Path) -> None:
    assert allocator.preload_env({allocator.SWITCH_ENV: "glibc"}, libs) == {}
    assert allocator.preload_env({"LD_PRELOAD": "/opt/mine.so"}, libs) == {}
    assert allocator.preload_env({}, (str(tmp_path / "empty"),)) == {}


def test_an_unknown_allocator_names_the_variable() -> None:
    with pytest.raises(OptionError, match=allocator.SWITCH_ENV) as err:
        allocator.preload_env({allocator.SWITCH_ENV: "jemallc"})
    assert err.value.exit_code == 2


def test_the_malloc_in_use_is_read_from_the_mapped_libraries(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f0-7f1 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2\n")
    assert allocator.in_use(maps) == "jemalloc"
    maps.write_text("7f0-7f1 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert allocator.in_use(maps) == "glibc"
