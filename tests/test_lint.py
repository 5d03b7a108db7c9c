"""The code's style, checked with the suite: ruff for Python, clang-format for the C++ kernels."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def tool(name: str) -> str:
    # The venv's own copy first: it is the pinned version (pyproject's test extra).
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed; run ./scripts/setup.sh (it installs the test extra)")
    return found


def test_ruff():
    result = subprocess.run([tool("ruff"), "check", "--no-cache", "pagellm", "tests", "scripts"], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_clang_format():
    sources = sorted(str(p.relative_to(REPO)) for p in (REPO / "pagellm" / "kernels" / "csrc").glob("*.[ch]*"))
    assert sources
    result = subprocess.run([tool("clang-format"), "--dry-run", "--Werror", *sources], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
