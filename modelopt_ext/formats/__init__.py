"""Low-level tensor storage formats (packing, scales, quantize/dequantize)."""
