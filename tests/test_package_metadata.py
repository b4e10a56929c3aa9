"""Every package's version, layout and dependency ranges, and core's extras in a built wheel."""

from __future__ import annotations

import importlib
import importlib.util
import re
import shutil
import subprocess
import tomllib
import zipfile
from email.parser import Parser
from importlib.machinery import SourceFileLoader
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).parents[1]
_LOADER = SourceFileLoader("release_check", str(ROOT / "scripts" / "release-check"))
release_check = importlib.util.module_from_spec(
    importlib.util.spec_from_loader("release_check", _LOADER)
)
_LOADER.exec_module(release_check)
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
BACKENDS = ("refit-zmq", "refit-nccl", "refit-dynamo", "refit-sglang")
REQUIREMENT = re.compile(r"^(refit-[a-z]+(?:\[[a-z]+\])?)([<>=!~].*)$")
CORE_THIRD_PARTY = {"sources": {"torch>=2.6"}, "vllm": {"torch>=2.6", "xxhash>=3.4"}}
"""refit-core's extras that install what its own modules import (refit_core.sources;
refit_core.vllm's worker modules), beside refit's packages."""


def project(name: str) -> dict[str, object]:
    data = tomllib.loads((ROOT / "packages" / name / "pyproject.toml").read_text())
    result: dict[str, object] = data["project"]
    return result


def test_every_package_is_present() -> None:
    assert (
        sorted(
            ["refit-core", "refit-zmq", "refit-nccl", "refit-dynamo", "refit-sglang", "refit-lab"]
        )
        == PACKAGES
    )


@pytest.mark.parametrize("name", PACKAGES)
def test_version_layout_and_readme(name: str) -> None:
    module_name = name.replace("-", "_")
    module = importlib.import_module(module_name)
    assert module.__version__ == project(name)["version"]
    package_dir = ROOT / "packages" / name
    assert (package_dir / "src" / module_name / "py.typed").exists()
    assert (package_dir / "tests").is_dir()
    assert (package_dir / "README.md").read_text().strip()


@pytest.mark.parametrize("name", [n for n in PACKAGES if n != "refit-core"])
def test_packages_depend_on_core_with_a_bounded_range(name: str) -> None:
    deps = project(name)["dependencies"]
    assert isinstance(deps, list)
    (core,) = [Requirement(d) for d in deps if Requirement(d).name == "refit-core"]
    operators = {spec.operator for spec in core.specifier}
    assert operators == {">=", "<"}, f"{name}: {core} needs a lower and an upper bound"


def test_every_declared_sibling_range_is_satisfied_by_the_workspace() -> None:
    assert release_check.sibling_problems(release_check.projects()) == []


def test_a_sibling_range_the_workspace_misses_is_reported() -> None:
    found = release_check.projects()
    found["refit-zmq"] = {**found["refit-zmq"], "dependencies": ["refit-core>=9.0,<10"]}
    (problem,) = release_check.sibling_problems(found)
    assert problem.startswith("refit-zmq needs refit-core>=9.0,<10, the workspace has")


@pytest.mark.parametrize("name", PACKAGES)
def test_a_release_tag_must_match_the_package(name: str) -> None:
    version = str(project(name)["version"])
    assert release_check.main([f"{name}-v{version}"]) == 0
    assert release_check.main([f"{name}-v{version}9"]) == 1
    assert release_check.main(["refit-nope-v0.1.0"]) == 1
    assert release_check.main([f"{name}-{version}"]) == 1


@pytest.mark.skipif(shutil.which("uv") is None, reason="uv builds the package")
def test_one_package_builds_alone(tmp_path: Path) -> None:
    subprocess.run(
        ["uv", "build", "--package", "refit-zmq", "--out-dir", str(tmp_path)],
        cwd=ROOT, check=True, capture_output=True, timeout=240,
    )  # fmt: skip
    version = project("refit-zmq")["version"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != ".gitignore") == [
        f"refit_zmq-{version}-py3-none-any.whl",
        f"refit_zmq-{version}.tar.gz",
    ]


def test_core_itself_has_no_dependencies() -> None:
    assert project("refit-core")["dependencies"] == []


@pytest.mark.parametrize("name", PACKAGES)
def test_the_changelog_starts_with_the_version_a_wheel_carries(name: str) -> None:
    text = (ROOT / "packages" / name / "CHANGELOG.md").read_text()
    first = re.search(r"^## (.*)$", text, flags=re.MULTILINE)
    assert first is not None
    assert first[1].split()[0] == project(name)["version"], (
        f"{name}'s CHANGELOG opens with '## {first[1]}', its wheels say {project(name)['version']}"
    )


@pytest.mark.skipif(shutil.which("uv") is None, reason="uv is needed to build a wheel")
def test_core_wheel_carries_extras_with_version_ranges(tmp_path: Path) -> None:
    subprocess.run(
        ["uv", "build", "--wheel", "--out-dir", str(tmp_path), "packages/refit-core"],
        cwd=ROOT, check=True, capture_output=True, timeout=240,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("refit_core-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        meta_name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = Parser().parsestr(archive.read(meta_name).decode())
    extras = set(metadata.get_all("Provides-Extra") or [])
    assert extras == {"sources", "vllm", "sglang", "dynamo", "megatron", "zmq", "nccl", "all"}
    requires = metadata.get_all("Requires-Dist") or []
    by_extra: dict[str, set[str]] = {}
    third_party: dict[str, set[str]] = {}
    for line in requires:
        requirement, _, marker = line.partition(";")
        extra = re.search(r"extra == ['\"]([a-z]+)['\"]", marker)
        assert extra, f"core has a non-optional dependency: {line}"
        spec = requirement.strip().replace(" ", "")
        if not spec.startswith("refit-"):
            third_party.setdefault(extra.group(1), set()).add(spec)
            continue
        parsed = REQUIREMENT.match(spec)
        assert parsed, f"no version range in {line}"
        sibling = Requirement(spec)
        assert {s.operator for s in sibling.specifier} == {">=", "<"}, line
        assert sibling.specifier.contains(project(sibling.name)["version"]), line
        by_extra.setdefault(extra.group(1), set()).add(parsed.group(1))
    assert third_party == CORE_THIRD_PARTY
    assert by_extra["vllm"] == {"refit-zmq", "refit-nccl"}
    assert by_extra["zmq"] == {"refit-zmq"}
    assert by_extra["nccl"] == {"refit-nccl"}
    assert by_extra["megatron"] == {"refit-nccl[megatron]"}
    assert by_extra["all"] >= {"refit-zmq", "refit-sglang", "refit-dynamo"}
    assert all(name in by_extra for name in ("sglang", "dynamo"))
