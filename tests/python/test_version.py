"""gradzip.__version__ is the version written once, in CMakeLists.txt's project() (pyproject.toml
takes it from there for the package metadata)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import gradzip


def test_version_is_the_cmake_project_version():
    if gradzip.__version__ == "0+unknown":
        pytest.skip("gradzip is not installed (a source checkout on sys.path): no package metadata")
    cmake = (Path(__file__).resolve().parents[2] / "CMakeLists.txt").read_text()
    assert gradzip.__version__ == re.search(r"project\(gradzip VERSION ([0-9.]+)", cmake).group(1)
