"""The generic fused routed-experts engine (`fused`) and its storages (`fused.DenseExperts`, `mxfp4.PackedExperts`);
a family's experts class adds its activation (models/<family>/experts.py)."""
