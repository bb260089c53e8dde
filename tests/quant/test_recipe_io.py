"""modelopt_ext.quant.recipe_io: reading recipe files, their shape checks, error messages and algorithm checks."""

import logging
import re
from pathlib import Path

import pytest
import yaml

from modelopt_ext.quant.recipe_io import (
    EntrySource,
    _check_bits,
    _display,
    _is_modelopt_default,
    _modelopt_file,
    _modelopt_prints_logged,
    _pydantic_errors,
    _read_raw,
    check_algorithm,
    check_calibrators,
)

HEADER = {"metadata": {"recipe_type": "ptq"}}


def _recipe(tmp_path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def _entries(tmp_path, quant_cfg, imports=None) -> Path:
    data = {**({"imports": imports} if imports else {}), **HEADER, "quantize": {"quant_cfg": quant_cfg}}
    return _recipe(tmp_path, yaml.safe_dump(data))


# ---- reading: _read_raw --------------------------------------------------------------------------------------


def test_a_header_and_a_body_are_read_as_one_recipe(tmp_path):
    path = _recipe(tmp_path, "imports: {fp8: configs/numerics/fp8}\n---\nmetadata: {recipe_type: ptq}\n"
                             "quantize:\n  quant_cfg:\n  - {quantizer_name: '*', enable: false}\n"
                             "  - {quantizer_name: '*o_proj*', cfg: {$import: fp8}}\n")
    assert _read_raw(path) == {"imports": {"fp8": "configs/numerics/fp8"}, "metadata": {"recipe_type": "ptq"},
                               "quantize": {"quant_cfg": [{"quantizer_name": "*", "enable": False},
                                                          {"quantizer_name": "*o_proj*", "cfg": {"$import": "fp8"}}]}}


@pytest.mark.parametrize("text, expected", [
    ("a: 1\n---\nb: 2\n---\nc: 3\n", "expected one YAML document (or a header and a body), got 3"),
    ("- 1\n- 2\n", "a recipe is a YAML mapping with imports, metadata, quantize; got list"),
    ("imports: {fp8: 5}\nmetadata: {recipe_type: ptq}\n",
     "imports must map names to config paths (strings), got {'fp8': 5}"),
    ("metadata: {recipe_type: ptq}\n", "quantize must be a mapping with quant_cfg and algorithm, got NoneType"),
    ("metadata: {recipe_type: ptq}\nquantize: {algorithm: max}\n",
     "quantize.quant_cfg must be a list of entries, got NoneType"),
], ids=["three-documents", "not-a-mapping", "import-not-a-path", "no-quantize", "no-quant-cfg"])
def test_malformed_recipes_are_refused_naming_the_file(tmp_path, text, expected):
    path = _recipe(tmp_path, text)
    with pytest.raises(ValueError) as info:
        _read_raw(path)
    assert str(info.value) == f"{path}: {expected}"


@pytest.mark.parametrize("entry, expected", [
    ("just a glob", "quantize.quant_cfg[0] must be a mapping, got str 'just a glob'"),
    ({"enable": False}, "quantize.quant_cfg[0] (quantizer_name None): quantizer_name must be a non-empty string"),
    ({"quantizer_name": "*x*"}, "quantize.quant_cfg[0] (quantizer_name '*x*'): an entry needs cfg, enable, or both"),
    ({"quantizer_name": "*x*", "cfg": 8}, "quantize.quant_cfg[0] (quantizer_name '*x*'): cfg must be a mapping of "
     "quantizer attributes (or a list of them), got int 8"),
    ({"quantizer_name": "*x*", "enable": False, "parent_class": 3},
     "quantize.quant_cfg[0] (quantizer_name '*x*'): parent_class must be a class name string"),
    ({"$import": ["fp8", "nvfp4"]},
     "quantize.quant_cfg[0]: $import of 'nvfp4', which imports does not declare (declared: fp8)"),
], ids=["not-a-mapping", "no-name", "neither-cfg-nor-enable", "cfg-not-a-mapping", "parent-class-not-a-name",
        "undeclared-import"])
def test_malformed_entries_are_refused_naming_file_and_entry(tmp_path, entry, expected):
    path = _entries(tmp_path, [entry], imports={"fp8": "configs/numerics/fp8"})
    with pytest.raises(ValueError) as info:
        _read_raw(path)
    assert str(info.value) == f"{path}: {expected}"


def test_an_import_without_declared_imports_says_none_are_declared(tmp_path):
    path = _entries(tmp_path, [{"quantizer_name": "*", "enable": False}, {"$import": "fp8"}])
    with pytest.raises(ValueError, match=r": quantize.quant_cfg\[1\]: \$import of 'fp8', which imports does not "
                                         r"declare \(declared: none\)$"):
        _read_raw(path)


# ---- where entries come from --------------------------------------------------------------------------------


def test_entry_source_names_file_entry_and_importer():
    assert str(EntrySource("r.yaml", "quantize.quant_cfg[2]")) == "r.yaml quantize.quant_cfg[2]"
    unit = EntrySource("unit.yaml", "entry [1]", imported_by="r.yaml quantize.quant_cfg[0]")
    assert str(unit) == "unit.yaml entry [1] (imported by r.yaml quantize.quant_cfg[0])"
    assert not unit.modelopt_default


def test_import_paths_resolve_in_the_working_directory_first_then_modelopt(tmp_path, monkeypatch):
    from modelopt.torch.opt.config_loader import BUILTIN_CONFIG_ROOT

    monkeypatch.chdir(tmp_path)
    builtin = BUILTIN_CONFIG_ROOT / "configs/ptq/units/base_disable_all.yaml"
    assert _modelopt_file("configs/ptq/units/base_disable_all") == builtin
    assert _display(builtin) == "<modelopt_recipes>/configs/ptq/units/base_disable_all.yaml"
    assert _is_modelopt_default(builtin)
    assert not _is_modelopt_default(BUILTIN_CONFIG_ROOT / "configs/numerics/fp8.yaml")
    local = tmp_path / "configs/ptq/units/base_disable_all.yml"
    local.parent.mkdir(parents=True)
    local.write_text("[]\n")
    found = _modelopt_file("configs/ptq/units/base_disable_all")
    assert found == Path("configs/ptq/units/base_disable_all.yml")  # relative to the working directory
    assert _display(found) == str(found) and not _is_modelopt_default(found)
    assert _modelopt_file("units/no_such_unit") is None


def test_modelopt_prints_go_to_the_debug_log_with_the_original_path(caplog, capsys):
    with caplog.at_level(logging.DEBUG, logger="modelopt_ext.quant.recipe_io"):
        with pytest.raises(RuntimeError):
            with _modelopt_prints_logged(("/tmp/x/r.yaml", "/home/me/r.yaml")):
                print("Loading recipe /tmp/x/r.yaml")
                raise RuntimeError("failed")
    assert capsys.readouterr().out == ""
    assert [r.getMessage() for r in caplog.records] == ["modelopt: Loading recipe /home/me/r.yaml"]


# ---- validation messages ------------------------------------------------------------------------------------


def test_pydantic_errors_are_one_line_per_deepest_location():
    from pydantic import BaseModel, ConfigDict, ValidationError

    class Model(BaseModel):
        model_config = ConfigDict(extra="forbid")
        items: list[int]
        either: int | str = 0
        nested: dict[str, int] | int = 0
        name: str

    with pytest.raises(ValidationError) as info:
        Model.model_validate({"items": [1, "a"], "either": [1], "nested": {"k": "x"}, "bogus": "z" * 100})
    assert _pydantic_errors(info.value) == [
        "items[1]: Input should be a valid integer, unable to parse string as an integer (got 'a')",
        "either: Input should be a valid integer or Input should be a valid string (got [1])",  # union labels dropped
        "nested.k: Input should be a valid integer, unable to parse string as an integer (got 'x')",
        "name: Field required",
        "bogus: Extra inputs are not permitted (got '" + "z" * 76 + "...)",
    ]
    assert _pydantic_errors(ValueError("not pydantic")) == []
    assert _pydantic_errors(None) == []


# ---- num_bits and calibrators -------------------------------------------------------------------------------


def test_a_num_bits_string_without_a_custom_backend_is_refused():
    source = EntrySource("r.yaml", "quantize.quant_cfg[0]")
    with pytest.raises(ValueError) as info:
        _check_bits([{"quantizer_name": "*w*", "cfg": {"num_bits": "int4"}}], [source])
    assert str(info.value) == ("r.yaml quantize.quant_cfg[0]: quantizer_name '*w*': cfg.num_bits is the string 'int4'; "
                               "expected an int (e.g. 8) or ExMy (e.g. e4m3); other strings are for a custom backend, "
                               "and this entry sets none")
    nvfp4 = {"num_bits": (2, 1), "block_sizes": {-1: 16, "scale_bits": "ue8"}}
    with pytest.raises(ValueError, match=r"^r.yaml quantize.quant_cfg\[0\]: quantizer_name '\*w\*': "
                                         r"cfg\[1\].block_sizes.scale_bits is the string 'ue8'; "):
        _check_bits([{"quantizer_name": "*w*", "cfg": [{"num_bits": 8}, nvfp4]}], [source])
    # ints, ExMy tuples and strings for a custom backend pass
    _check_bits([{"quantizer_name": "*a*", "cfg": {"num_bits": 8}},
                 {"quantizer_name": "*b*", "cfg": {"num_bits": (4, 3), "block_sizes": {-1: 16, "scale_bits": (4, 3)}}},
                 {"quantizer_name": "*c*", "cfg": {"num_bits": "int4", "backend": "mine"}},
                 {"quantizer_name": "*d*", "enable": False}], [source] * 4)


def test_calibrators_other_than_max_are_refused_on_enabled_entries():
    quant_cfg = [{"quantizer_name": "*", "enable": False},
                 {"quantizer_name": "*off*", "enable": False, "cfg": {"calibrator": "histogram"}},
                 {"quantizer_name": "*in*", "cfg": [{"num_bits": 8}, {"calibrator": "max"}]},
                 {"quantizer_name": "*x*", "cfg": [{"num_bits": 8}, {"calibrator": "histogram"}]}]
    with pytest.raises(ValueError) as info:
        check_calibrators(quant_cfg, "after --set")
    message = str(info.value)
    assert message.startswith("after --set quantize.quant_cfg[3]: quantizer_name '*x*': cfg[1].calibrator is "
                              "'histogram'; modelopt_ext calibrates with ModelOpt's max calibrator only: ")
    assert message.endswith("drop calibrator (activation amax: max; weight amax searches: quantize.algorithm.method "
                            "mse or local_hessian)")
    with pytest.raises(ValueError, match=re.escape("quantize.quant_cfg[0]: quantizer_name '*y*': cfg.calibrator is a "
                                                   "dict constructor; ")):
        check_calibrators([{"quantizer_name": "*y*", "cfg": {"calibrator": {"type": "histogram"}}}], "r.yaml")
    check_calibrators(quant_cfg[:3], "r.yaml")
    # _check_bits applies the same rule to the entries of a loaded recipe
    with pytest.raises(ValueError, match=r"^r.yaml entry: quantizer_name '\*x\*': cfg\[1\].calibrator is 'histogram'"):
        _check_bits(quant_cfg[3:], [EntrySource("r.yaml", "entry")])


# ---- quantize.algorithm -------------------------------------------------------------------------------------


def test_algorithms_calibrate_runs_pass_the_check():
    for algorithm in ("max", "mse", {"method": "local_hessian"}, {"method": "max", "layerwise": {"enable": False}},
                      {"method": "mse", "distributed_sync": True}):
        check_algorithm(algorithm, "here")


def test_an_algorithm_of_another_type_is_refused():
    with pytest.raises(ValueError) as info:
        check_algorithm(5, "r.yaml")
    assert str(info.value) == "r.yaml: quantize.algorithm must be a method name or a mapping with method, got int 5"
    with pytest.raises(ValueError, match=r"^r.yaml: quantize.algorithm.method: unknown calibration algorithm 5; "
                                         r"valid: local_hessian, max, mse \(ModelOpt "):
        check_algorithm({"method": 5}, "r.yaml")
