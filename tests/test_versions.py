"""modelopt_ext.versions: installed versions and the version floors checked before anything is patched."""

import importlib.metadata

import pytest

from modelopt_ext import versions


@pytest.fixture
def installed(monkeypatch):
    """`installed[dist] = version` fakes what is installed (a distribution not in the dict is missing)."""
    table: dict[str, str] = {}
    monkeypatch.setattr(versions, "installed_version", table.get)
    return table


def test_installed_version_reads_the_metadata_and_is_none_when_missing():
    assert versions.installed_version("packaging") == importlib.metadata.version("packaging")
    assert versions.installed_version("no-such-distribution-modelopt-ext-test") is None


def test_versions_at_or_above_the_floor_pass(installed):
    # the release numbers are compared: a local build tag or a pre-release of the floor's release passes
    installed.update({"torch": "2.7.0+cpu", "transformers": "5.23.0rc1", "fla-core": "0.10"})
    versions.check_min_versions({"torch": "2.7", "transformers": "5.23", "fla-core": "0.5.1"})


def test_a_version_below_its_floor_is_refused_numerically(installed):
    installed.update({"transformers": "5.3.0"})  # 5.3 < 5.23 as versions (not as strings)
    with pytest.raises(RuntimeError) as info:
        versions.check_min_versions({"transformers": "5.23"})
    assert str(info.value) == "unsupported environment: transformers 5.3.0 is below the supported floor 5.23"


def test_every_problem_is_named_and_optional_distributions_may_be_missing(installed):
    installed.update({"torch": "2.6.9", "transformers": "5.23"})
    floors = {"torch": "2.7", "accelerate": "1.0", "transformers": "5.23", "fla-core": "0.5.1"}
    with pytest.raises(RuntimeError) as info:
        versions.check_min_versions(floors, optional=frozenset({"fla-core"}))
    assert str(info.value) == ("unsupported environment: torch 2.6.9 is below the supported floor 2.7; "
                               "accelerate is not installed (need >= 1.0)")
    with pytest.raises(RuntimeError, match=r"^unsupported environment: fla-core is not installed \(need >= 0.5.1\)$"):
        versions.check_min_versions({"fla-core": "0.5.1"})
    versions.check_min_versions({"fla-core": "0.5.1"}, optional=frozenset({"fla-core"}))
