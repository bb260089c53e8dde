"""modelopt_ext.fingerprint: what ranks compare before loading; equal for copies, different (per file) for a
changed config, header, size or tensor data."""

from __future__ import annotations

import json

from modelopt_ext.fingerprint import data_samples, input_fingerprint
from modelopt_ext.testing.checkpoints import copy_checkpoint

SHARD = "model-00002-of-00003.safetensors"


def _differing(a: dict, b: dict) -> list[str]:
    return sorted(k.split("/", 1)[1] for k in a if a[k] != b[k])


def test_copies_agree_and_each_kind_of_change_names_its_file(tiny_ckpt, tmp_path):
    one, two = copy_checkpoint(tiny_ckpt, tmp_path / "a", "ckpt"), copy_checkpoint(tiny_ckpt, tmp_path / "b", "ckpt")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("x")
    rel = lambda root: {k.replace(str(root), "ROOT"): v for k, v in input_fingerprint(root, {"--recipe": recipe}).items()}  # noqa: E731
    reference = rel(one)
    assert reference == rel(two) and "--recipe " + str(recipe) in reference
    assert any(k.endswith(SHARD) for k in reference) and any(k.endswith("config.json") for k in reference)

    config = json.loads((two / "config.json").read_text())
    (two / "config.json").write_text(json.dumps({**config, "stale": True}))
    assert _differing(reference, rel(two)) == ["config.json"]
    (two / "config.json").write_text((one / "config.json").read_text())

    shard = two / SHARD
    data = bytearray(shard.read_bytes())
    length = int.from_bytes(data[:8], "little")
    last = len(data) - 1  # the last data byte: inside a sample
    data[last] ^= 1
    shard.write_bytes(bytes(data))
    assert _differing(reference, rel(two)) == [SHARD]
    data[last] ^= 1
    data[8 + 2] = ord(" ") if data[8 + 2] != ord(" ") else ord("\t")  # header bytes, same size
    shard.write_bytes(bytes(data))
    assert _differing(reference, rel(two)) == [SHARD]
    shard.write_bytes(bytes(data) + b"junk")
    assert _differing(reference, rel(two)) == [SHARD]
    assert length > 0


def test_data_samples_cover_the_middle_of_a_large_shard(tmp_path):
    shard = tmp_path / "x.safetensors"
    header = b"{}"
    body = bytearray(1 << 20)
    shard.write_bytes(len(header).to_bytes(8, "little") + header + bytes(body))
    before = data_samples(shard)
    body[len(body) // 3] = 1  # the second of four evenly spaced samples starts at a third of the data
    shard.write_bytes(len(header).to_bytes(8, "little") + header + bytes(body))
    assert data_samples(shard) != before
