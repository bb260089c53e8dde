"""modelopt_ext.provenance: the toolchain versions, the provenance record of an export and its file."""

import enum
import hashlib
import importlib.metadata
import json
import types

import yaml

from modelopt_ext import provenance


class _Method(enum.Enum):
    MAX = "max"


class _Recipe(dict):
    """A loaded recipe: a mapping with the path it was read from."""

    path = None


def test_versions_lists_every_distribution_and_none_for_absent_ones(monkeypatch):
    assert provenance.versions()["torch"] == importlib.metadata.version("torch")
    real = importlib.metadata.version

    def version(name):
        if name == "fla-core":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(provenance.metadata, "version", version)
    found = provenance.versions()
    assert list(found) == list(provenance.DISTRIBUTIONS)
    assert found["fla-core"] is None
    assert found["safetensors"] == real("safetensors")


def test_build_records_recipe_source_calibration_and_distribution(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lock = tmp_path / "remote_code.lock.json"
    lock.write_bytes(b'{"files": {}}\n')
    recipe = _Recipe(metadata={"recipe_type": "ptq"}, quantize={"algorithm": {"method": _Method.MAX}, "quant_cfg": []})
    recipe.path = tmp_path / "mine.yaml"
    family = types.SimpleNamespace(name="kimi_k3", revision="abc123")
    record = provenance.build(
        recipe_name="mine", recipe=recipe, overrides=("quantize.algorithm.method=max",), source="ckpt",
        family=family, lock=lock, calibration={"tokens": 64, "experts_seen": [3, 4]}, distribution={"ep": 2},
    )
    assert record["producer"] == {"name": "modelopt_ext", "version": importlib.metadata.version("modelopt-ext")}
    assert record["versions"] == provenance.versions()
    assert record["recipe"]["name"] == "mine"
    assert record["recipe"]["path"] == str(tmp_path / "mine.yaml")
    assert record["recipe"]["overrides"] == ["quantize.algorithm.method=max"]
    # the resolved recipe as plain YAML: the enum is written as its value, the key order kept
    assert record["recipe"]["resolved_yaml"].startswith("metadata:\n")
    assert yaml.safe_load(record["recipe"]["resolved_yaml"]) == {
        "metadata": {"recipe_type": "ptq"}, "quantize": {"algorithm": {"method": "max"}, "quant_cfg": []}}
    assert record["source"] == {
        "path": str(tmp_path / "ckpt"), "family": "kimi_k3", "revision": "abc123", "remote_code_lock": str(lock),
        "remote_code_lock_sha256": hashlib.sha256(b'{"files": {}}\n').hexdigest(),
    }
    assert record["calibration"] == {"tokens": 64, "experts_seen": [3, 4]}
    assert record["distribution"] == {"ep": 2}
    json.dumps(record)  # JSON-safe as written


def test_build_of_a_recipe_without_a_path_records_an_empty_path(tmp_path):
    lock = tmp_path / "lock.json"
    lock.write_text("{}")
    record = provenance.build(recipe_name="r", recipe={"quantize": {}}, overrides=[], source=tmp_path,
                              family=types.SimpleNamespace(name="f", revision=None), lock=lock, calibration={},
                              distribution={})
    assert record["recipe"]["path"] == "" and record["recipe"]["overrides"] == []
    assert record["source"]["revision"] is None


def test_write_puts_indented_json_in_the_export(tmp_path):
    data = {"producer": {"name": "modelopt_ext"}, "distribution": {"ep": 1}}
    provenance.write(tmp_path, data)
    text = (tmp_path / "modelopt_ext_provenance.json").read_text()
    assert text == json.dumps(data, indent=2) + "\n"
    assert provenance.PROVENANCE_NAME == "modelopt_ext_provenance.json"


def test_a_family_without_remote_code_records_no_lock(tmp_path):
    """A family whose classes are transformers' own (no remote code, no lock) is recorded with none."""
    family = types.SimpleNamespace(name="native", revision=None)
    record = provenance.build(recipe_name="r", recipe={"quantize": {}}, overrides=(), source=tmp_path, family=family,
                              lock=None, calibration={}, distribution={})
    assert record["source"]["remote_code_lock"] is None and record["source"]["remote_code_lock_sha256"] is None
    assert record["source"]["revision"] is None and record["source"]["family"] == "native"
