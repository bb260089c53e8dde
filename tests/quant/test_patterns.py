"""modelopt_ext.quant.patterns: `quant_cfg` quantizer globs checked against a small ModelOpt-converted model."""

import pytest
import torch
from torch import nn

from modelopt_ext.quant.patterns import _name_matches, check_patterns_match, enabled_quantizers, quantizers
from modelopt_ext.quant.recipe_io import EntrySource

ENABLED = {"quantizer_name": "*o_proj.weight_quantizer", "cfg": {"num_bits": 8}}


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.ModuleDict({"q_proj": nn.Linear(4, 4), "o_proj": nn.Linear(4, 4)})
        self.norm = nn.LayerNorm(4)
        self.A_log = nn.Parameter(torch.zeros(4))  # a parameter ModelOpt does not wrap
        self.experts = nn.Module()


@pytest.fixture(scope="module")
def model():
    """Tiny with ModelOpt's quantizers (no calibration): every quantizer off but o_proj's weight quantizer, and
    fused-experts-style per-expert quantizers in a ModuleList."""
    from modelopt.torch.quantization.conversion import replace_quant_module, set_quantizer_by_cfg
    from modelopt.torch.quantization.nn import TensorQuantizer

    tiny = Tiny()
    replace_quant_module(tiny)
    tiny.experts.gate_up_proj_weight_quantizers = nn.ModuleList([TensorQuantizer(), TensorQuantizer()])
    set_quantizer_by_cfg(tiny, [{"quantizer_name": "*", "enable": False}, ENABLED])
    return tiny


def test_expert_list_indices_collapse_when_matching():
    name = "layers.1.experts.gate_up_proj_weight_quantizers.7"
    assert _name_matches("*experts.gate_up_proj_weight_quantizer", name)  # the index collapsed
    assert _name_matches("*gate_up_proj_weight_quantizers.7", name)  # the name itself
    assert not _name_matches("*gate_up_proj_weight_quantizers.6", name)
    assert _name_matches("*down_proj_input_quantizer.a", "x.down_proj_input_quantizers.12.a")
    assert not _name_matches("*experts.gate_up_proj_weight_quantizer", "x.experts.gate_up_proj_weight_quantizers")
    assert not _name_matches("*O_PROJ*", "attn.o_proj.weight_quantizer")  # case-sensitive, as ModelOpt


def test_quantizers_and_the_enabled_ones(model):
    found = quantizers(model)
    assert set(found) == {f"attn.{p}.{q}_quantizer" for p in ("q_proj", "o_proj") for q in ("input", "weight", "output")
                          } | {"norm.input_quantizer", "norm.output_quantizer",
                               "experts.gate_up_proj_weight_quantizers.0", "experts.gate_up_proj_weight_quantizers.1"}
    assert list(enabled_quantizers(model)) == ["attn.o_proj.weight_quantizer"]


def test_entries_that_match_pass(model):
    check_patterns_match([
        {"quantizer_name": "*", "enable": False},
        ENABLED,
        {"quantizer_name": "*A_log*", "enable": False},  # a disabling entry may name a parameter without a quantizer
        {"quantizer_name": "*experts.gate_up_proj_weight_quantizer", "enable": False},  # per-expert list
        {"quantizer_name": "*input_quantizer", "parent_class": "nn.LayerNorm", "enable": False},
    ], model)


def test_every_entry_that_matches_nothing_is_named(model):
    with pytest.raises(ValueError) as info:
        check_patterns_match([
            {"quantizer_name": "*", "enable": False},
            {"quantizer_name": "*o_prj.weight_quantizer", "cfg": {"num_bits": 8}},
            {"quantizer_name": "*dt_bais*", "enable": False},
            {"quantizer_name": "*A_log*", "cfg": {"num_bits": 8}},  # enabling: must hit a quantizer
            {"quantizer_name": "*o_proj.input_quantizer", "parent_class": "nn.LayerNorm", "enable": False},
            {"quantizer_name": "*", "parent_class": "nn.NoSuchLayer", "enable": False},
        ], model)
    assert str(info.value) == (
        "quantizer patterns that match nothing:\n"
        "  quant_cfg [1]: quantizer_name '*o_prj.weight_quantizer' matches no quantizer of Tiny\n"
        "  quant_cfg [2]: quantizer_name '*dt_bais*' matches no quantizer, module or parameter of Tiny\n"
        "  quant_cfg [3]: quantizer_name '*A_log*' matches no quantizer of Tiny\n"
        "  quant_cfg [4]: quantizer_name '*o_proj.input_quantizer' matches no quantizer, module or parameter of Tiny\n"
        "  quant_cfg [5]: parent_class 'nn.NoSuchLayer' is not a ModelOpt quant class"
    )


class _Loaded(dict):
    """A loaded recipe: its entries' sources beside the data."""

    sources = None


def test_recipe_forms_and_their_sources(model):
    typo = {"quantizer_name": "*q_prj*", "enable": False}
    loaded = _Loaded(quantize={"quant_cfg": [ENABLED, typo, typo]})
    loaded.sources = [EntrySource("r.yaml", "quantize.quant_cfg[0]"), EntrySource("r.yaml", "quantize.quant_cfg[1]"),
                      EntrySource("<modelopt_recipes>/unit.yaml", "entry [0]", modelopt_default=True)]
    # the typo from a ModelOpt default unit is exempt; the one from the recipe is named by its source
    with pytest.raises(ValueError, match=r"^quantizer patterns that match nothing:\n  r.yaml quantize.quant_cfg\[1\]: "
                                         r"quantizer_name '\*q_prj\*' matches no quantizer, module or parameter of Tiny$"):
        check_patterns_match(loaded, model)
    # what quant_config returns (a mapping with quant_cfg): sources by index
    with pytest.raises(ValueError, match=r"\n  quant_cfg \[1\]: quantizer_name '\*q_prj\*'"):
        check_patterns_match({"quant_cfg": [ENABLED, typo], "algorithm": "max"}, model)
    check_patterns_match({"quant_cfg": [ENABLED], "algorithm": "max"}, model)


def test_a_model_without_quantizers_is_refused():
    with pytest.raises(ValueError, match=r"^Linear has no quantizers: check the model mtq.quantize returned$"):
        check_patterns_match([ENABLED], nn.Linear(2, 2))
