"""The `ptq` run's configuration: one frozen, checked record built once, by the CLI or by Python callers.

    config = PtqConfig(model="ckpt", export_dir="out", recipe="kimi_k3/fp8_all", calib_size=64)
    summary = modelopt_ext.run_ptq(config)            # or, from parsed CLI arguments: PtqConfig.from_args(ns)

Construction checks every value that can be checked without reading a file (sizes positive and finite, choices,
the experts options, the timeout's bound) and raises ValueError naming the command-line flag, so the CLI and
the API refuse the same input with the same words. The ranks of a run agree on `to_dict()` before anything is
read. `hashed()` is the part that decides the calibration and the exported bytes: a `--resume` run must match
it (quant/resume.py). Field names are the flags' (`calib_size` is `--calib-size`), except `overrides` (`--set`),
`engines` (`--engine`, flattened) and `experts_options` (`--experts-option NAME=VALUE`, parsed once, here).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from modelopt_ext.dist import DEFAULT_TIMEOUT_S
from modelopt_ext.options import DEFAULT, ExpertsOptions

MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: the bound on one collective wait must be a real bound
POSITIVE = ("calib_size", "batch_size", "seq_len", "ep", "experts_per_file", "timeout")
CHOICES = {
    "dense": (None, "replicate", "fsdp"),
    "dtype": ("bfloat16", "float32"),
    "experts_implementation": (None, "eager", "grouped_mm", "batched_mm"),
    "uncovered_experts": ("weights", "all-experts", "fail"),  # quant.calibrate.POLICIES (a test keeps them equal)
    "expert_input_scales": ("shared", "per-expert"),
}
ENGINE_NAMES = ("vllm", "sglang", "trtllm", "all")  # export.engine_names.ENGINES and "all"
# fields whose flag is not their name
FLAGS = {"overrides": "--set", "engines": "--engine", "experts_options": "--experts-option"}
# options that change neither the calibration nor the export's bytes (every other one must match on --resume;
# a field added later is compared by default)
NOT_HASHED = ("resume", "overwrite", "no_progress", "timeout", "summary_json", "export_dir", "engines",
              "quality_blocks", "no_warmup")


def flag(field: str) -> str:
    return FLAGS.get(field, "--" + field.replace("_", "-"))


@dataclasses.dataclass(frozen=True)
class PtqConfig:
    """Everything `modelopt-ext ptq` takes (`modelopt-ext ptq --help` describes each flag; docs/ptq.md)."""

    model: str  # the checkpoint folder
    export_dir: str
    recipe: str | None = None  # a shipped recipe name or a YAML path; None: the family's default
    qformat: str | None = None  # an hf_ptq.py preset, mapped to a recipe (exclusive with recipe)
    overrides: tuple[str, ...] = ()  # recipe KEY=VALUE overrides (--set)
    overwrite: bool = False
    resume: bool = False
    calib_size: int = 512
    batch_size: int = 4
    seq_len: int = 512
    dataset: str | None = None
    ep: int | None = None
    dense: str | None = None
    dtype: str = "bfloat16"
    experts_implementation: str | None = None
    experts_options: ExpertsOptions = DEFAULT
    remote_code_lock: str | None = None
    uncovered_experts: str = "weights"
    expert_input_scales: str = "shared"
    quality_blocks: int = 0
    experts_per_file: int | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    summary_json: str | None = None
    engines: tuple[str, ...] = ()  # none: those the family names for the recipe (ServingSpec.recipe_engines), else all
    no_progress: bool = False
    no_warmup: bool = False

    def __post_init__(self):
        for name in ("model", "export_dir"):
            value = getattr(self, name)
            if not isinstance(value, (str, Path)):  # an empty one is refused in validate, with its likely cause
                raise ValueError(f"{flag(name)} must be a path, got {value!r}")
            object.__setattr__(self, name, str(value))
        for name in ("recipe", "dataset", "remote_code_lock", "summary_json"):
            value = getattr(self, name)
            if isinstance(value, Path):
                object.__setattr__(self, name, str(value))
        if self.recipe is not None and self.qformat is not None:
            raise ValueError(f"--recipe {self.recipe} and --qformat {self.qformat}: give one of them")
        for name in ("overrides", "engines"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{flag(name)}: expected a sequence of strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        unknown = [e for e in self.engines if e not in ENGINE_NAMES]
        if unknown:
            raise ValueError(f"--engine {','.join(self.engines)}: expected names from {', '.join(ENGINE_NAMES)}")
        if not isinstance(self.experts_options, ExpertsOptions):
            raise ValueError(f"experts_options must be a modelopt_ext.options.ExpertsOptions, got "
                             f"{self.experts_options!r}")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{flag(name)} {getattr(self, name)!r}: expected one of "
                                 f"{', '.join(str(a) for a in allowed if a is not None)}")
        for name in POSITIVE:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                    name != "timeout" and not isinstance(value, int)):
                raise ValueError(f"{flag(name)} must be a number, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{flag(name)} must be a finite number, got {value}")
            if value <= 0:
                raise ValueError(f"{flag(name)} must be positive, got {value}")
        if not isinstance(self.quality_blocks, int) or self.quality_blocks < 0:
            raise ValueError(f"--quality-blocks must be 0 (no quality report) or positive, got {self.quality_blocks}")
        if self.timeout > MAX_TIMEOUT_S:
            raise ValueError(f"--timeout {self.timeout:g} s is more than a week ({MAX_TIMEOUT_S:g} s); it bounds every "
                             "wait between ranks")

    @classmethod
    def from_args(cls, args: Any) -> PtqConfig:
        """From `modelopt-ext ptq`'s parsed arguments (an argparse Namespace; the hf_ptq spellings are aliases)."""
        values = {k: v for k, v in vars(args).items() if not callable(v)}
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in values.items() if k in fields}
        kwargs["overrides"] = tuple(values.get("set") or ())
        kwargs["engines"] = tuple(e for names in (values.get("engine") or []) for e in names)
        kwargs["experts_options"] = ExpertsOptions.parse(values.get("experts_option") or ())
        return cls(**kwargs)

    def replace(self, **changes: Any) -> PtqConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain values by field (the experts options as their dict), for the ranks' agreement and logs."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["experts_options"] = self.experts_options.to_dict()
        data["overrides"], data["engines"] = list(self.overrides), list(self.engines)
        return data

    def hashed(self) -> dict[str, Any]:
        """The options that decide the calibration and the export (all but `NOT_HASHED`), by flag; the
        checkpoint as an absolute path (as the export's provenance records it), the experts options as the
        sorted NAME=VALUE items that differ from the defaults."""
        config: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            if field.name in NOT_HASHED:
                continue
            value = getattr(self, field.name)
            if field.name == "model":
                value = str(Path(value).absolute())
            elif field.name == "experts_options":
                value = sorted(_changed(value.to_dict(), DEFAULT.to_dict()))
            elif isinstance(value, tuple):
                value = list(value)
            config[flag(field.name)] = value
        return dict(sorted(config.items()))


def _changed(values: Mapping[str, Any], defaults: Mapping[str, Any]) -> Iterable[str]:
    return (f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items() if defaults[k] != v)
