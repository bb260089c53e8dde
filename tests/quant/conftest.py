"""Fixtures shared by the recipe-checking tests of quant/: the stand-in's config, its family's serving facts,
and shipped recipes with entries added."""

from __future__ import annotations

import json

import pytest
import yaml

from modelopt_ext.families import family_for_config
from modelopt_ext.quant import recipes as R


@pytest.fixture(scope="module")
def config(tiny_ckpt):
    return json.loads((tiny_ckpt / "config.json").read_text())


@pytest.fixture(scope="module")
def serving(config):
    return family_for_config(config, source="test").serving


@pytest.fixture
def recipe_with(tmp_path):
    """`recipe_with(entries, base, imports=None)`: the path of shipped recipe kimi_k3/`base` with `entries` added
    before its last two entries (ModelOpt's defaults, the family's exclusions) and `imports` merged in."""

    def write(entries: list, base: str, imports: dict | None = None):
        data = yaml.safe_load((R.RECIPES_DIR / "kimi_k3" / f"{base}.yaml").read_text())
        data["quantize"]["quant_cfg"][-2:-2] = entries
        data["imports"].update(imports or {})
        path = tmp_path / f"{base}-with-entries.yaml"
        path.write_text(yaml.safe_dump(data))
        return path

    return write
