"""Packaging metadata agrees with itself: license, Ray floor, the image's constraints."""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parent.parent


def _project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "docker" / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[name.lower()] = version
    return pins


def test_license_is_an_spdx_string_with_the_apache_text_beside_it():
    project = _project()
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_every_constraint_satisfies_the_packages_own_requirements():
    project = _project()
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for r in project["optional-dependencies"]["sglang"]]
    pins = _pins()
    for req in reqs:
        if req.name.lower() in pins:
            assert req.specifier.contains(pins[req.name.lower()]), (req, pins[req.name.lower()])
    assert {"sglang", "torch", "ray", "sglang-router", "smg"} <= set(pins)


def test_the_ray_floor_is_the_one_the_compatibility_page_states():
    ray = next(Requirement(r) for r in _project()["dependencies"] if r.startswith("ray"))
    floor = next(s.version for s in ray.specifier if s.operator == ">=")
    page = (REPO / "docs" / "COMPATIBILITY.md").read_text()
    assert f"| Ray | **{floor}** (oldest supported)" in page


def test_the_image_installs_with_the_constraints_file():
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert "-c docker/constraints.txt" in dockerfile
    assert "COPY docker/constraints.txt" in dockerfile and "LICENSE" in dockerfile
