"""Version floors, checked before anything is patched."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping

from packaging.version import Version


def installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_min_versions(floors: Mapping[str, str], optional: frozenset[str] = frozenset()) -> None:
    """Raise RuntimeError naming every distribution below its floor (or missing, unless `optional`)."""
    problems = []
    for dist, floor in floors.items():
        version = installed_version(dist)
        if version is None:
            if dist not in optional:
                problems.append(f"{dist} is not installed (need >= {floor})")
        elif Version(version).release < Version(floor).release:
            problems.append(f"{dist} {version} is below the supported floor {floor}")
    if problems:
        raise RuntimeError("unsupported environment: " + "; ".join(problems))
