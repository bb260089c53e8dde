"""Resume: the calibration state each rank saves after calibrating, and `ptq --resume`, which exports from it.

    directory = state_dir(export_dir)                 # <parent>/.<export name>.calibration/
    save_state(directory, header, result, tokens)      # after calibration, on every rank
    saved = check_saved(directory, expected_header)    # --resume, in validate: refuses a different run
    result, tokens = restore(model, quant_cfg, directory, saved)   # instead of the forward passes

What a rank writes (`rank{r}.safetensors`, tensors only, and `rank{r}.json`, the header): every ModelOpt
TensorQuantizer's properties (`get_modelopt_state(properties_only=True)` plus the block-shape attributes
ModelOpt sets while calibrating) and its buffers (amax...), the per-expert input amax of the fused experts
(`expert_input_amax`, export/expert_inputs.py), the coverage counts, `CalibrationResult.max_weight_amax`,
the amax-sync report and this rank's calibration tokens. The header also holds what the state depends on,
compared before anything is loaded on resume: the run's options (`PtqConfig.hashed()`), the checkpoint's fingerprint
(`fingerprint.input_fingerprint`), the sha256 of the remote-code lock, the recipe file, the resolved recipe
and the dataset, the versions `provenance.versions()` records, the world size, the EP degree and the rank.

Writes are staged: a file is written under a hidden temporary name and renamed; the header is written last
(it holds the sha256 of the tensors file), and a rank removes its old header before writing anything, so an
interrupted write leaves a state that `check_saved` reports as missing or damaged, never one that looks
complete. Tensors are read back with safetensors only (never pickle).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from modelopt_ext.lock import sha256_file

logger = logging.getLogger(__name__)

STATE_SUFFIX = ".calibration"  # `.NAME.calibration` beside the export dir NAME
FORMAT = 1
KIND = "modelopt_ext calibration state"
# attributes ModelOpt sets on a quantizer while calibrating but leaves out of its modelopt_state
SHAPE_ATTRIBUTES = ("_original_shape", "_block_reshape_size", "_padding")
TMP_MARK = ".tmp-"


class StateError(ValueError):
    """No usable saved calibration state (missing, damaged, or from a different run); names what differs."""


def state_dir(export_dir: Path) -> Path:
    """Where the ranks keep their calibration state: a hidden sibling of the (resolved) export dir."""
    export_dir = Path(export_dir)
    return export_dir.parent / f".{export_dir.name}{STATE_SUFFIX}"


def _files(directory: Path, rank: int) -> tuple[Path, Path]:
    return directory / f"rank{rank}.json", directory / f"rank{rank}.safetensors"


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def expected_header(run, *, recipe, lock: Path | None, rank: int, world_size: int,
                    ep_size: int | None) -> dict[str, Any]:
    """What a state saved by this run holds besides its tensors (and what a resumed run must find); `run` is the
    run's `modelopt_ext.run_config.PtqConfig`, whose `hashed()` options must match."""
    from modelopt_ext.fingerprint import input_fingerprint
    from modelopt_ext.provenance import versions

    config = run.hashed()
    prefix = f"--model {Path(run.model)}/"
    checkpoint = {name.removeprefix(prefix): value for name, value in input_fingerprint(run.model, {}).items()}
    resolved = json.loads(json.dumps(dict(recipe), default=lambda v: getattr(v, "value", str(v))))
    inputs = {"the remote-code lock": None if lock is None else sha256_file(lock),
              "--recipe file": sha256_file(recipe.path),
              "the resolved recipe": _digest(resolved),
              "--dataset": sha256_file(Path(run.dataset)) if run.dataset else None}
    return {"kind": KIND, "format": FORMAT, "rank": rank, "world_size": world_size, "ep_size": ep_size,
            "config": config, "config_sha256": _digest(config), "checkpoint": checkpoint,
            "checkpoint_sha256": _digest(checkpoint), "remote_code_lock": {"path": lock and str(lock), "sha256": inputs[
                "the remote-code lock"]}, "inputs": inputs, "versions": versions()}


def check_location(directory: Path, model_dir, files: Mapping[str, Any]) -> None:
    """The state dir passes the export target's checks (never on, above or inside the checkpoint, never
    holding an input; `export.target.check_export_target`) and is a directory if it exists."""
    from modelopt_ext.export.target import ExportDirError, check_export_target

    try:
        check_export_target(directory, model_dir, files)
    except ExportDirError as e:
        raise StateError(f"calibration state dir: {e}") from e
    if directory.exists() and not directory.is_dir():
        raise StateError(f"calibration state dir {directory} exists and is not a directory")
    place = directory
    while not place.exists():
        place = place.parent
    if not os.access(place, os.W_OK | os.X_OK):
        raise StateError(f"calibration state dir {directory}: cannot write in {place}")


def saved_exists(directory: Path, rank: int) -> bool:
    return _files(directory, rank)[0].is_file()


def read_header(directory: Path, rank: int) -> dict[str, Any]:
    """This rank's saved header, its tensors file checked against the sha256 it records."""
    header_path, _ = _files(directory, rank)
    if not header_path.is_file():
        raise StateError(
            f"--resume: no saved calibration state for rank {rank}: {header_path} does not exist (a run of the same "
            "command without --resume saves it after calibrating; it is removed once its export is published); "
            "run without --resume")
    try:
        header = json.loads(header_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise StateError(f"--resume: {header_path} is unreadable ({e}); run without --resume") from e
    if not isinstance(header, dict) or header.get("kind") != KIND or header.get("format") != FORMAT:
        raise StateError(f"--resume: {header_path} is not a modelopt_ext calibration state of format {FORMAT} "
                         f"(kind {header.get('kind') if isinstance(header, dict) else None!r}, format "
                         f"{header.get('format') if isinstance(header, dict) else None!r}); run without --resume")
    tensors = directory / header["tensors"]["file"]
    found = sha256_file(tensors) if tensors.is_file() else "missing"
    if found != header["tensors"]["sha256"]:
        raise StateError(f"--resume: {tensors} does not match {header_path} (sha256 {found}, recorded "
                         f"{header['tensors']['sha256']}): the state is damaged; run without --resume")
    return header


def _show(value: Any) -> str:
    if value is None:
        return "not given"
    return str(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else repr(value)


def differences(saved: Mapping[str, Any], expected: Mapping[str, Any]) -> list[str]:
    """What changed between a saved header and this run's, one phrase each ("--calib-size was 64, now 32")."""
    out = []
    for key, what in (("world_size", "world size"), ("ep_size", "EP degree")):
        if saved.get(key) != expected[key]:
            out.append(f"{what} was {saved.get(key) or 'none'}, now {expected[key] or 'none'}")
    old, new = saved.get("config", {}), expected["config"]
    out += [f"{k} was {_show(old.get(k))}, now {_show(new.get(k))}" for k in sorted(old.keys() | new.keys())
            if old.get(k) != new.get(k)]
    old, new = saved.get("checkpoint", {}), expected["checkpoint"]
    files = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
    if files:
        shown = ", ".join(f if f in old and f in new else f"{f} ({'new' if f in new else 'gone'})" for f in files[:5])
        out.append(f"checkpoint files differ: {shown}" + (f" and {len(files) - 5} more" if len(files) > 5 else ""))
    old, new = saved.get("inputs", {}), expected["inputs"]
    out += [f"{k} changed (sha256 was {str(old.get(k))[:12]}..., now {str(new.get(k))[:12]}...)"
            for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)]
    old, new = saved.get("versions", {}), expected["versions"]
    out += [f"{k} was {old.get(k)}, now {new.get(k)}" for k in sorted(old.keys() | new.keys())
            if old.get(k) != new.get(k)]
    if saved.get("rank") != expected["rank"]:
        out.append(f"the file is rank {saved.get('rank')}'s, read by rank {expected['rank']}")
    return out


def check_saved(directory: Path, expected: Mapping[str, Any]) -> dict[str, Any]:
    """This rank's saved header if it was written by a run of this configuration; StateError naming every
    difference (or the missing or damaged file) otherwise."""
    header = read_header(directory, expected["rank"])
    changed = differences(header, expected)
    if changed:
        raise StateError(f"--resume: the calibration state in {directory} was saved by a different run: "
                         + "; ".join(changed) + "; run without --resume to calibrate again (it replaces the state)")
    return header


# ------------------------------------------------------------------------------------ property codec (JSON)


def _encode(value: Any, where: str) -> Any:
    """A quantizer property as JSON: tagged objects for what JSON lacks; ValueError for anything else."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, torch.Size):
        return {"size": list(value)}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, where) for v in value]}
    if isinstance(value, list):
        return [_encode(v, where) for v in value]
    if isinstance(value, dict):
        return {"dict": [[_encode(k, where), _encode(v, where)] for k, v in value.items()]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, slice):
        return {"slice": [_encode(value.start, where), _encode(value.stop, where), _encode(value.step, where)]}
    raise ValueError(f"{where} is a {type(value).__name__} ({value!r:.80}); the calibration state stores plain "
                     "values, tuples, lists, dicts, dtypes and slices")


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    (tag, data), = value.items()
    if tag == "float":
        return float(data)
    if tag == "size":
        return torch.Size(data)
    if tag == "tuple":
        return tuple(_decode(v) for v in data)
    if tag == "dict":
        return {_decode(k): _decode(v) for k, v in data}
    if tag == "dtype":
        dtype = getattr(torch, str(data), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{data!r} in a saved quantizer property is not a torch dtype")
        return dtype
    if tag == "slice":
        return slice(*(_decode(v) for v in data))
    raise ValueError(f"unknown tag {tag!r} in a saved quantizer property")


# --------------------------------------------------------------------------------------------- save / load


def _plain_tensor(t: torch.Tensor, where: str) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        raise ValueError(f"{where} is a DTensor; the calibration state stores plain tensors")
    return t.detach().to("cpu", copy=True).contiguous()


def _collect(model: nn.Module, result, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The header's description of the calibrated state; its tensors added to `tensors`."""
    from modelopt.torch.quantization.nn import TensorQuantizer

    quantizers, sets, index = {}, [], {}  # property sets are shared by many quantizers: stored once each
    for name, q in model.named_modules():
        if not isinstance(q, TensorQuantizer):
            continue
        if any(p is not None for p in q._parameters.values()):
            raise ValueError(f"quantizer {name} has parameters ({sorted(q._parameters)}); the calibration state "
                             "saves buffers and properties only")
        properties = q.get_modelopt_state(properties_only=True)
        properties.update({k: getattr(q, k) for k in SHAPE_ATTRIBUTES if k in q.__dict__})
        buffers = {}
        for key, t in q._buffers.items():
            if t is None:
                continue
            tensors[f"q/{name}/{key}"] = _plain_tensor(t, f"{name}.{key}")
            buffers[key] = {"persistent": key not in q._non_persistent_buffers_set, "device": t.device.type}
        encoded = {k: _encode(v, f"{name}.{k}") for k, v in sorted(properties.items())}
        key = json.dumps([type(q).__name__, encoded], sort_keys=True)
        if key not in index:
            index[key] = len(sets)
            sets.append({"type": type(q).__name__, "properties": encoded})
        quantizers[name] = {"set": index[key], "buffers": buffers}
    expert_inputs = {}
    for name, m in model.named_modules():
        if callable(getattr(m, "reset_expert_input_amax", None)) and m.expert_input_amax:
            expert_inputs[name] = {}
            for projection, t in sorted(m.expert_input_amax.items()):
                tensors[f"xin/{name}/{projection}"] = _plain_tensor(t, f"{name} expert_input_amax[{projection}]")
                expert_inputs[name][projection] = t.device.type
    for router, t in result.coverage.counts.items():
        tensors[f"coverage/{router}"] = _plain_tensor(t, f"coverage of {router}")
    for name, t in (result.max_weight_amax or {}).items():
        tensors[f"max_weight_amax/{name}"] = _plain_tensor(t, f"max_weight_amax of {name}")
    return {"property_sets": sets, "quantizers": quantizers, "expert_input_amax": expert_inputs,
            "coverage": {"num_experts": result.coverage.num_experts, "routers": sorted(result.coverage.counts)},
            "max_weight_amax": None if result.max_weight_amax is None else {
                n: t.device.type for n, t in sorted(result.max_weight_amax.items())},
            "sync": json.loads(json.dumps(result.sync, default=str)) if result.sync is not None else None}


def _write(path: Path, write) -> None:
    """`write(tmp)`, fsync, then rename to `path`: a reader sees the whole file or none."""
    tmp = path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}")
    try:
        write(tmp)
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_state(directory: Path, header: Mapping[str, Any], result, tokens: int) -> int:
    """Write this rank's state (module doc) into `directory`, replacing an earlier one; returns its bytes."""
    from safetensors.torch import save_file

    rank = header["rank"]
    header_path, tensors_path = _files(directory, rank)
    directory.mkdir(parents=True, exist_ok=True)
    if header_path.exists():
        logger.info("rank %d: replacing the calibration state of an earlier run in %s", rank, directory)
    header_path.unlink(missing_ok=True)  # first: from here on the old state no longer looks complete
    if rank == 0:  # ranks of an earlier, larger run
        for path in directory.glob("rank*.*"):
            stem = path.name.partition(".")[0].removeprefix("rank")
            if stem.isdigit() and int(stem) >= header["world_size"]:
                path.unlink(missing_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    record = _collect(result.model, result, tensors)
    _write(tensors_path, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    saved = {"time": time.time(), "host": socket.gethostname(), "pid": os.getpid()}
    full = {**header, "kind": KIND, "format": FORMAT, **record, "tokens": int(tokens), "saved": saved,
            "tensors": {"file": tensors_path.name, "sha256": sha256_file(tensors_path), "count": len(tensors)}}
    _write(header_path, lambda tmp: tmp.write_text(json.dumps(full, separators=(",", ":")) + "\n"))
    return tensors_path.stat().st_size + header_path.stat().st_size


def remove_state(directory: Path, rank: int, *, keep_dir: bool = False) -> None:
    """This rank's files; rank 0 also removes the dir once nothing else is in it (call it after every other
    rank's), unless `keep_dir`."""
    for path in _files(directory, rank):
        path.unlink(missing_ok=True)
    if rank == 0 and not keep_dir and directory.is_dir():
        for path in directory.glob(f".*{TMP_MARK}*"):
            path.unlink(missing_ok=True)
        left = sorted(p.name for p in directory.iterdir())
        if left:
            logger.warning("calibration state dir %s kept: it holds other files (%s)", directory, ", ".join(left[:5]))
        else:
            directory.rmdir()


def _device(kind: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


def restore(model: nn.Module, quant_cfg: Mapping[str, Any], directory: Path, header: Mapping[str, Any]):
    """ModelOpt's conversion of `model` with `quant_cfg` (as `calibrate.calibrate` converts it, without
    calibration), then every quantizer, the fused experts' per-expert input amax, the coverage and the max
    weight amax as saved. Returns (CalibrationResult, this rank's calibration tokens)."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.quantization.nn import TensorQuantizer
    from safetensors.torch import load_file

    from modelopt_ext.ep.backend import restore_ep_forwards
    from modelopt_ext.ep.sharding import local_expert_params

    from .calibrate import CalibrationResult, _integer_params_under_fsdp, name_parent_class_rules
    from .coverage import Coverage
    from .recipe_io import check_calibrators

    started = time.perf_counter()
    tensors_path = directory / header["tensors"]["file"]
    tensors = load_file(str(tensors_path))
    cfg = dict(quant_cfg)
    cfg["algorithm"] = None  # conversion only: the calibration is the saved one
    if isinstance(cfg.get("quant_cfg"), list):
        check_calibrators(cfg["quant_cfg"], "quant config")
        cfg["quant_cfg"] = name_parent_class_rules(cfg["quant_cfg"], model)
    with _integer_params_under_fsdp(model), local_expert_params(model):  # as calibrate converts (its doc)
        model = mtq.quantize(model, cfg, None)
    restore_ep_forwards(model)
    quantizers = {n: q for n, q in model.named_modules() if isinstance(q, TensorQuantizer)}
    saved = header["quantizers"]
    missing, extra = sorted(saved.keys() - quantizers.keys()), sorted(quantizers.keys() - saved.keys())
    if missing or extra:
        raise StateError(f"the model's quantizers differ from those saved in {tensors_path}: {len(missing)} saved "
                         f"but absent (first {missing[:3]}), {len(extra)} not saved (first {extra[:3]})")
    sets = header["property_sets"]
    for name, entry in saved.items():
        q, kept = quantizers[name], sets[entry["set"]]
        if type(q).__name__ != kept["type"]:
            raise StateError(f"quantizer {name} is a {type(q).__name__}, saved as a {kept['type']}")
        for key, value in kept["properties"].items():
            setattr(q, key, _decode(value))
        calibrator = getattr(q, "_calibrator", None)
        if calibrator is not None:  # as ModelOpt's set_from_modelopt_state does
            for key in ("_num_bits", "_axis", "_unsigned"):
                setattr(calibrator, key, getattr(q, key))
        for key in list(q._buffers):
            del q._buffers[key]
            q._non_persistent_buffers_set.discard(key)
        for key, b in entry["buffers"].items():
            q.register_buffer(key, tensors[f"q/{name}/{key}"].to(_device(b["device"])), persistent=b["persistent"])
    for name, projections in header["expert_input_amax"].items():
        module = model.get_submodule(name)
        module.reset_expert_input_amax()
        for projection, kind in projections.items():
            module.expert_input_amax[projection] = tensors[f"xin/{name}/{projection}"].to(_device(kind))
    coverage = Coverage(header["coverage"]["num_experts"],
                        {r: tensors[f"coverage/{r}"] for r in header["coverage"]["routers"]})
    devices = header["max_weight_amax"]
    max_weight_amax = None if devices is None else {
        n: tensors[f"max_weight_amax/{n}"].to(_device(kind)) for n, kind in devices.items()}
    seconds = {"restore": round(time.perf_counter() - started, 3)}
    logger.info(coverage.summary_line())
    return CalibrationResult(model, coverage, header.get("sync"), seconds, max_weight_amax), int(header["tokens"])
