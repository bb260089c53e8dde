"""Quantization with ModelOpt: recipes (YAML, loaded through ModelOpt's recipe loader) and their checks.

Importing this package imports ModelOpt first, on a thread of its own (`modelopt_import`), so that the
modules below (which import ModelOpt, some at module level) never pin their importer's stack."""

from modelopt_ext.quant.modelopt_import import import_modelopt

import_modelopt()

from modelopt_ext.quant.recipes import (  # noqa: E402 - after ModelOpt's first import, on purpose
    RECIPES_DIR,
    QuantConfig,
    Recipe,
    RecipeNotFoundError,
    available_recipes,
    check_patterns_match,
    enabled_quantizers,
    load,
    quant_config,
    recipe_for_qformat,
    resolve_recipe,
)

__all__ = [
    "RECIPES_DIR",
    "QuantConfig",
    "Recipe",
    "RecipeNotFoundError",
    "available_recipes",
    "check_patterns_match",
    "enabled_quantizers",
    "load",
    "quant_config",
    "recipe_for_qformat",
    "resolve_recipe",
]
