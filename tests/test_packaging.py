"""pyproject.toml and environment.yml must list the same packages (two ways to install, one set)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; the dev venv and CI have it


def normalize(requirement: str) -> str:
    """PEP 503 name of a requirement string: 'Foo_Bar>=1; marker' -> 'foo-bar'."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert name, f"not a requirement: {requirement!r}"
    return re.sub(r"[-_.]+", "-", name.group(1)).lower()


def pyproject_requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project.get("optional-dependencies", {})
    return project["dependencies"] + [req for group in extras.values() for req in group]


def environment_pip_requirements() -> list[str]:
    """The entries of the `pip:` list in environment.yml, read without a YAML library."""
    lines = (ROOT / "environment.yml").read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "- pip:")
    indent = len(lines[start]) - len(lines[start].lstrip())
    entries = []
    for line in lines[start + 1:]:
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if len(line) - len(line.lstrip()) <= indent:
            break  # back at the level of `- pip:`: the list has ended
        entries.append(stripped.removeprefix("-").split("#")[0].strip())
    return entries


def test_environment_yml_lists_what_pyproject_lists() -> None:
    in_pyproject = {normalize(r) for r in pyproject_requirements()}
    in_environment = {normalize(r) for r in environment_pip_requirements()}
    assert in_pyproject - in_environment == set(), "add these to environment.yml"
    assert in_environment - in_pyproject == set(), "add these to pyproject.toml"


def test_torch_is_a_range_not_a_build_pin() -> None:
    # A CUDA-specific pin (torch==2.x+cu12x) would break CPU installs and the Makefile's
    # install-torch-first step; the exact build is chosen by TORCH_SPEC in the Makefile.
    (torch,) = [r for r in pyproject_requirements() if normalize(r) == "torch"]
    assert "+" not in torch and "==" not in torch, torch


def test_package_data_and_python_floor() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["project"]["requires-python"] == ">=3.10"
    assert "configs/*/config.json" in config["tool"]["setuptools"]["package-data"]["nanovllm"]
