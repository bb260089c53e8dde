"""Model families: one folder per family; importing this package registers the built-in families, in this order
(listings by family, e.g. the bundled configs `modelopt-ext plan` names, follow it)."""

from modelopt_ext.models.kimi_k3 import spec as _kimi_k3_spec  # noqa: F401, I001  (registers the family)
from modelopt_ext.models.deepseek_v3 import spec as _deepseek_v3_spec  # noqa: F401  (registers the family)
