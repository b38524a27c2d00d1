"""Packaging checks: the wheel's package list stays in step with the source tree."""

from __future__ import annotations

from pathlib import Path

import tomllib
from setuptools import find_packages

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_lists_every_package() -> None:
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = set(find_packages(str(ROOT), include=["sysx", "sysx.*"]))
    missing = found - listed
    assert not missing, f"add these packages to [tool.setuptools] packages in pyproject.toml: {sorted(missing)}"
    assert "sysx.conf" in listed


def test_constraints_pin_torch() -> None:
    pins = (ROOT / "constraints.txt").read_text().split()
    assert "torch==2.13.0" in pins
