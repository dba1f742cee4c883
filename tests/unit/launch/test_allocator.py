"""The workers' malloc: which library the launcher preloads, and when it leaves the environment alone."""

from __future__ import annotations

from pathlib import Path

import subprocess

import pytest

from trainyard.errors import OptionError
from trainyard.launch import allocator


@pytest.fixture
def libs(tmp_path: Path) -> tuple[str, ...]:
    """A library folder holding jemalloc and tcmalloc files (their names are all the launcher looks at)."""
    for file in ("libjemalloc.so.2", "libtcmalloc_minimal.so.4"):
        (tmp_path / file).write_bytes(b"")
    return (str(tmp_path),)


def fine(path: str) -> None:
    """A library that breaks nothing (the files above are empty)."""
    return None


def test_the_preferred_library_is_preloaded_where_present(libs: tuple[str, ...]) -> None:
    assert allocator.preload_env({}, libs, fine) == {"LD_PRELOAD": f"{libs[0]}/libjemalloc.so.2"}
    got = allocator.preload_env({allocator.SWITCH_ENV: "tcmalloc"}, libs, fine)
    assert got == {"LD_PRELOAD": f"{libs[0]}/libtcmalloc_minimal.so.4"}


def test_nothing_is_preloaded_when_switched_off_absent_or_the_user_preloads(libs: tuple[str, ...],
                                                                            tmp_path: Path) -> None:
    assert allocator.preload_env({allocator.SWITCH_ENV: "glibc"}, libs, fine) == {}
    assert allocator.preload_env({"LD_PRELOAD": "/opt/mine.so"}, libs, fine) == {}
    assert allocator.preload_env({}, (str(tmp_path / "empty"),), fine) == {}


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


@pytest.fixture
def breaking_library(tmp_path: Path) -> str:
    """A real shared library whose loading ends the process, as a preload that breaks an environment's extensions
    ends `import torch` (a conda libstdc++ shadowed by the system's: "GLIBCXX_3.4.30 not found")."""
    source = tmp_path / "breaks.c"
    source.write_text('#include <unistd.h>\n#include <stdio.h>\n'
                      '__attribute__((constructor)) static void breaks(void) '
                      '{ fputs("version GLIBCXX_3.4.32 not found\\n", stderr); _exit(1); }\n')
    library = tmp_path / "libbreaks.so"
    built = subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(library), str(source)], capture_output=True, text=True)
    if built.returncode != 0:
        pytest.skip(f"no C compiler to build the library: {built.stderr.strip()[:200]}")
    return str(library)


def test_a_library_that_breaks_import_torch_is_not_preloaded_and_the_first_log_line_says_why(
    breaking_library: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    checks = tmp_path / "checks.json"
    monkeypatch.setattr(allocator, "CHECKS", checks)
    added = allocator.preload_env({allocator.SWITCH_ENV: breaking_library})
    assert "LD_PRELOAD" not in added
    why = added[allocator.SKIPPED_ENV]
    assert why.startswith(f"{breaking_library} not preloaded: with it `import torch` fails")
    assert "GLIBCXX_3.4.32 not found" in why
    assert allocator.describe(added) == f"{allocator.describe({})} ({why})"  # tuned or not: process-wide

    def no_second_try(*args: object, **kwargs: object) -> None:
        raise AssertionError("the verdict is read back, not tried again")

    monkeypatch.setattr(allocator.subprocess, "run", no_second_try)
    assert allocator.preload_problem(breaking_library, checks) == why.split("with it ", 1)[1]


def test_a_library_this_environment_takes_is_preloaded(tmp_path: Path) -> None:
    library = allocator.find_library(allocator.PREFERRED)
    if library is None:
        pytest.skip("no jemalloc on this machine (apt-get install libjemalloc2)")
    assert allocator.preload_problem(library, tmp_path / "checks.json") is None
    assert allocator.preload_env({}, problem=lambda path: allocator.preload_problem(path, tmp_path / "c.json")) == {
        "LD_PRELOAD": library
    }


FREED_AFTER = """
import ctypes, json, sys
from trainyard.launch import allocator
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
tuned = allocator.return_freed_memory({"TRAINYARD_ALLOCATOR": sys.argv[1]})
def rss():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS")) << 10
libc.free(libc.malloc(16 << 20))  # a large free: glibc's own threshold rises past the blocks below
blocks = [libc.malloc(8 << 20) for _ in range(8)]
for block in blocks:
    ctypes.memset(block, 1, 8 << 20)
guard = libc.malloc(2 << 20)  # above the blocks (no free chunk that large below them): the top cannot be trimmed
ctypes.memset(guard, 1, 2 << 20)
held = rss()
for block in blocks:
    libc.free(block)
print(json.dumps({"tuned": tuned, "returned": held - rss(), "describe": allocator.describe({})}))
"""


@pytest.mark.skipif(allocator.in_use() != "glibc", reason="glibc's malloc only")
def test_on_glibc_freed_tensors_go_back_to_the_kernel_unless_switched_off() -> None:
    """Sixty-four MiB in blocks of 8 MiB, allocated after a 16 MiB free and then freed: with the thresholds set they
    were mappings and go back at once; with TRAINYARD_ALLOCATOR=off glibc's threshold had risen to 16 MiB, they came
    from the heap and stay in the process."""
    import json
    import sys

    def run(switch: str) -> dict:
        found = subprocess.run([sys.executable, "-c", FREED_AFTER, switch], capture_output=True, text=True, check=True)
        return json.loads(found.stdout)

    tuned, untouched = run("jemalloc"), run(allocator.OFF)
    assert tuned["tuned"] and not untouched["tuned"]
    assert tuned["returned"] >= 56 << 20, tuned
    assert untouched["returned"] < 8 << 20, untouched
    assert "freed blocks of >= 1 MiB returned" in tuned["describe"]
