"""modelopt_ext: expert-parallel calibration and quantized export of Kimi-K3-class MoE checkpoints."""

__version__ = "0.1.0"


def from_pretrained(path, **kwargs):
    """See `modelopt_ext.loading.from_pretrained`."""
    from modelopt_ext.loading import from_pretrained as _from_pretrained

    return _from_pretrained(path, **kwargs)


__all__ = ["from_pretrained", "__version__"]
