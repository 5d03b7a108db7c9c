"""constraints.txt pins every dependency, and this environment runs the pinned versions."""
from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parent.parent


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep, f"constraints.txt: {line!r} is not an exact pin"
            pins[_name(name)] = version
    return pins


def test_every_declared_dependency_is_pinned() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    pins = _pins()
    missing = sorted({_name(r) for r in declared} - set(pins))
    assert not missing, f"not pinned in constraints.txt: {missing}"


def test_installed_versions_are_the_pinned_ones() -> None:
    wrong = {}
    for name, version in _pins().items():
        try:
            installed = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # an optional extra not installed here
        if installed != version:
            wrong[name] = (installed, version)
    assert not wrong, f"installed (got, pinned): {wrong}"
