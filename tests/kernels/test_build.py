"""Kernel build cache location, cache keys and the fallback when compiling fails."""
from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from pagellm.kernels import build


def test_cache_dir_follows_environment(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path / "pc"))
    assert build.cache_dir() == tmp_path / "pc" / "extensions"
    monkeypatch.delenv("PAGELLM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert build.cache_dir() == tmp_path / "xdg" / "pagellm" / "extensions"


def test_build_tag_depends_on_flags() -> None:
    tags = {build._build_tag(flags) for flags in build.flag_sets()}
    assert len(tags) == len(build.flag_sets())
    assert build._build_tag(build.flag_sets()[0]) == build._build_tag(build.flag_sets()[0])


def test_cpu_arch_from_environment(monkeypatch) -> None:
    monkeypatch.setenv("PAGELLM_CPU_ARCH", "x86-64-v3")
    flags = build.flag_sets()[0]
    assert "-march=x86-64-v3" in flags and "-march=native" not in flags


def test_importing_the_build_does_not_import_attention() -> None:
    # The kernels are the bottom layer: attention, models and sampling import them, never back.
    code = "import sys, pagellm.kernels.build, pagellm.kernels.ops, pagellm.kernels.tuning; print(sorted(sys.modules))"
    modules = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert "pagellm.kernels.ops" in modules
    assert not any(layer in modules for layer in ("pagellm.attention", "pagellm.models", "pagellm.sample"))


def test_compile_failure_falls_back_with_one_warning(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "flag_sets", lambda: (("-O3", "--no-such-compiler-flag"),))
    monkeypatch.setattr(build, "_loaded", None)
    with pytest.warns(UserWarning, match="torch fallback"):
        assert build.load_kernels() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the failure is remembered: no second warning
        assert build.load_kernels() is False
    assert "no-such-compiler-flag" in (build.load_error() or "")


@pytest.mark.skipif(not build.load_kernels(), reason="C++ kernel unavailable")
def test_second_start_loads_from_cache() -> None:
    # The library was built by now; a fresh interpreter must load it without compiling.
    code = (
        "import time, torch; t = time.perf_counter();"
        "from pagellm.kernels.build import load_kernels;"
        "assert load_kernels(); print(time.perf_counter() - t)"
    )
    seconds = float(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
    assert seconds < 3.0


def test_remove_stale_builds_keeps_current_tags(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    root = build.cache_dir()
    current = root / f"{build.LIB_NAME}_{build._build_tag(build.flag_sets()[0])}"
    stale = root / f"{build.LIB_NAME}_0123456789abcdef"
    unrelated = root / "something_else"
    for path in (current, stale, unrelated):
        path.mkdir(parents=True)
    assert build.remove_stale_builds() == [stale]
    assert current.is_dir() and unrelated.is_dir() and not stale.exists()
