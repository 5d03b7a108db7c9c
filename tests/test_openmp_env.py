"""``import pagellm`` keeps OpenMP workers spinning between parallel regions, unless the user chose."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

_SHOW = "import os, pagellm; print(os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))"


def _env_after_import(**overrides: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env.update(overrides)
    return subprocess.run([sys.executable, "-c", _SHOW], env=env, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({}, "100000 None"),  # the default: spin, then sleep
        ({"GOMP_SPINCOUNT": "5"}, "5 None"),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, "None PASSIVE"),  # a policy alone stays the user's
    ],
)
def test_spin_count_default_and_user_settings(overrides, expected) -> None:
    assert _env_after_import(**overrides) == expected
