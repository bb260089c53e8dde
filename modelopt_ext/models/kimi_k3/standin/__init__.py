"""The tiny Kimi-K3 stand-in: remote-code files shipped into generated checkpoints, and the generator.

The three `configuration_kimi_k3.py`, `modeling_kimi_k3.py` and `modeling_kimi_linear.py` files are the
stand-in's remote code: they are copied verbatim into every generated checkpoint and loaded from there
by transformers with `trust_remote_code=True`.
"""
