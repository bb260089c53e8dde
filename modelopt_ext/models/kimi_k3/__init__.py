"""Kimi-K3 (model_type `kimi_k3`, text model `kimi_linear`)."""
