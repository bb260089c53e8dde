"""modelopt_ext: expert-parallel calibration and quantized export of Kimi-K3-class MoE checkpoints."""

__version__ = "0.1.0"
