"""The tiny DeepSeek-V3 stand-in checkpoint (`generate.make_tiny`): the real checkpoint's files, keys, dtypes
and FP8 block format at tiny sizes, loadable by transformers' native `DeepseekV3ForCausalLM` (no remote code)."""
