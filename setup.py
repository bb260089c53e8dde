"""Package layout that pyproject.toml cannot state: the quantization recipes are kept at the repository's top
level (`recipes/`) and ship inside the package as `modelopt_ext/recipes` (`modelopt_ext.quant.recipes` finds
them in either place). Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["modelopt_ext*"]) + [
        "modelopt_ext.recipes", "modelopt_ext.recipes.kimi_k3", "modelopt_ext.recipes.deepseek_v3",
        "modelopt_ext.recipes.units"],
    package_dir={"modelopt_ext.recipes": "recipes"},
)
