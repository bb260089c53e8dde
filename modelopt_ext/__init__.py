"""modelopt_ext: expert-parallel calibration and quantized export of Kimi-K3-class MoE checkpoints.

    model = modelopt_ext.from_pretrained(path, ep_size=8, trust_remote_code=True)   # under torchrun
    summary = modelopt_ext.run_ptq(modelopt_ext.PtqConfig(model=path, export_dir=out))  # what `ptq` runs
"""

__version__ = "0.1.0"


def from_pretrained(path, **kwargs):
    """See `modelopt_ext.loading.from_pretrained`."""
    from modelopt_ext.loading import from_pretrained as _from_pretrained

    return _from_pretrained(path, **kwargs)


def run_ptq(config, **kwargs):
    """See `modelopt_ext.ptq.run_ptq`: validate, load, calibrate, export and check a run of `config`."""
    from modelopt_ext.ptq import run_ptq as _run_ptq

    return _run_ptq(config, **kwargs)


def __getattr__(name):
    if name == "PtqConfig":  # imported on first use: `import modelopt_ext` stays free of torch
        from modelopt_ext.run_config import PtqConfig

        return PtqConfig
    raise AttributeError(f"module 'modelopt_ext' has no attribute {name!r}")


__all__ = ["from_pretrained", "run_ptq", "PtqConfig", "__version__"]
