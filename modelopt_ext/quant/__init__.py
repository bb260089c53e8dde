"""Quantization with ModelOpt: recipes (YAML, loaded through ModelOpt's recipe loader) and their checks."""

from modelopt_ext.quant.recipes import (
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
