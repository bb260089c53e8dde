"""Model families: one folder per family; importing this package registers the built-in families."""

from modelopt_ext.models.kimi_k3 import spec as _kimi_k3_spec  # noqa: F401  (registers the family)
