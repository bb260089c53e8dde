"""Model-agnostic expert parallelism: token dispatch/combine and the `torch_a2a` backend for transformers."""
