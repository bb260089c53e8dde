"""modelopt_ext.export.manifest: check (5) of verify_export on hand-made folders."""

from __future__ import annotations

import hashlib

from modelopt_ext.export.manifest import MANIFEST_NAME, _check_manifest, file_digests

_WHY = (f"modelopt-ext's exporter always writes {MANIFEST_NAME}, so this export is incomplete or was not written "
        "by modelopt-ext; for an export of ModelOpt's own export_hf_checkpoint, `modelopt-ext verify "
        "--write-manifest` checks it and writes one")


def test_missing_manifest_is_a_problem(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    problems: list[str] = []
    assert _check_manifest(tmp_path / MANIFEST_NAME, file_digests(tmp_path), problems) is False
    assert problems == [f"{tmp_path / MANIFEST_NAME} is missing: {_WHY}"]


def test_manifest_that_is_not_a_file_is_a_problem(tmp_path):
    (tmp_path / MANIFEST_NAME).mkdir()
    problems: list[str] = []
    assert _check_manifest(tmp_path / MANIFEST_NAME, file_digests(tmp_path), problems) is False
    assert problems == [f"{tmp_path / MANIFEST_NAME} is not a file: {_WHY}"]


def test_matching_manifest_passes(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    digest = hashlib.sha256(b"{}").hexdigest()
    (tmp_path / MANIFEST_NAME).write_text(f"{digest}  config.json\n")
    problems: list[str] = []
    assert _check_manifest(tmp_path / MANIFEST_NAME, file_digests(tmp_path), problems) is True
    assert problems == []


def test_known_digests_are_taken_without_reading_the_file(tmp_path):
    """The exporter passes the digests its ranks worked out while writing; those files are not read again (a
    deliberately wrong digest shows it was taken as given), the others are hashed."""
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model-00001.safetensors").write_bytes(b"tensor bytes")
    digests = file_digests(tmp_path, known={"model-00001.safetensors": "0" * 64})
    assert digests == {"config.json": hashlib.sha256(b"{}").hexdigest(), "model-00001.safetensors": "0" * 64}
    assert file_digests(tmp_path)["model-00001.safetensors"] == hashlib.sha256(b"tensor bytes").hexdigest()
