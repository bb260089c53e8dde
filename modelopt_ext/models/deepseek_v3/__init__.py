"""DeepSeek-V3 architecture (model_type `deepseek_v3`: DeepSeek-V3/R1; `kimi_k2`: Kimi-K2), loaded with
transformers' native `DeepseekV3ForCausalLM`; registered by `spec.py` (`modelopt_ext/models/__init__.py`)."""
