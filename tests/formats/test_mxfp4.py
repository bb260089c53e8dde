"""Tests for modelopt_ext.formats.mxfp4 (OCP MXFP4 / compressed-tensors mxfp4-pack-quantized)."""

import math

import pytest
import torch

from modelopt_ext.formats import mxfp4
from modelopt_ext.formats.mxfp4 import (
    E2M1_VALUES,
    GROUP_SIZE,
    SCALE_BIAS,
    dequantize_mxfp4,
    e8m0_to_float,
    pack_e2m1,
    quantize_mxfp4,
    unpack_e2m1,
)

# Hand-written E2M1 table (code order), independent of the module's constant.
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
ALL_SCALES = torch.arange(0, 255, dtype=torch.uint8)  # every legal E8M0 byte
F32_MAX = torch.finfo(torch.float32).max


def _all_codes_group_packed(n_rows: int) -> torch.Tensor:
    """[n_rows, 16] packed bytes; each row's 32 codes are 0..15 twice (so code 7 = 6.0 is present)."""
    codes = torch.arange(16, dtype=torch.uint8).repeat(2).expand(n_rows, GROUP_SIZE).contiguous()
    return pack_e2m1(codes)


def _assert_identical(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bitwise-style equality: same dtype, values, and sign of zeros."""
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b)
    assert torch.equal(torch.signbit(a), torch.signbit(b))


def test_constants():
    assert GROUP_SIZE == 32 and SCALE_BIAS == 127
    assert E2M1_VALUES.dtype == torch.float32
    _assert_identical(E2M1_VALUES, torch.tensor(E2M1_TABLE, dtype=torch.float32))
    assert torch.signbit(E2M1_VALUES[8]) and E2M1_VALUES[8] == 0


def test_pack_unpack_all_codes_every_nibble_position():
    lo = torch.arange(16, dtype=torch.uint8).repeat_interleave(16)
    hi = torch.arange(16, dtype=torch.uint8).repeat(16)
    codes = torch.stack((lo, hi), dim=-1).flatten()  # every (low, high) pair once
    packed = pack_e2m1(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (256,)
    assert torch.equal(packed, lo | (hi << 4))
    assert sorted(packed.tolist()) == list(range(256))
    assert torch.equal(unpack_e2m1(packed), codes)
    assert torch.equal(pack_e2m1(unpack_e2m1(torch.arange(256, dtype=torch.uint8))), torch.arange(256, dtype=torch.uint8))


def test_pack_layout_low_nibble_first():
    assert pack_e2m1(torch.tensor([1, 2], dtype=torch.uint8)).tolist() == [0x21]
    assert pack_e2m1(torch.tensor([[0xF, 0x0, 0x8, 0x7]], dtype=torch.uint8)).tolist() == [[0x0F, 0x78]]
    assert unpack_e2m1(torch.tensor([0x21, 0xA3], dtype=torch.uint8)).tolist() == [1, 2, 3, 10]


def test_e8m0_to_float_exact():
    ref = torch.tensor([math.ldexp(1.0, s - 127) for s in range(255)], dtype=torch.float64)
    _assert_identical(e8m0_to_float(ALL_SCALES, torch.float64), ref)
    _assert_identical(e8m0_to_float(ALL_SCALES), ref.float())  # every 2**k, k in [-127, 127], fits float32
    assert torch.equal(e8m0_to_float(ALL_SCALES).double(), ref)


def _dequant_reference() -> torch.Tensor:
    """[255, 32] float64: E2M1_TABLE[code] * 2**(s - 127), computed with Python floats."""
    codes = list(range(16)) * 2
    return torch.tensor(
        [[math.ldexp(E2M1_TABLE[c], s - 127) for c in codes] for s in range(255)], dtype=torch.float64
    )


def test_dequantize_every_code_every_scale_float64():
    out = dequantize_mxfp4(_all_codes_group_packed(255), ALL_SCALES[:, None], dtype=torch.float64)
    _assert_identical(out, _dequant_reference())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_every_code_every_scale_narrow(dtype):
    ref = _dequant_reference()
    out = dequantize_mxfp4(_all_codes_group_packed(255), ALL_SCALES[:, None], dtype=dtype)
    finite = ref.abs() <= F32_MAX
    assert finite[:253].all() and not finite[253:].all()  # 6 * 2**126 is the first overflow
    assert torch.equal(ref[finite].to(dtype).double(), ref[finite])  # reference exactly representable
    _assert_identical(out[finite], ref[finite].to(dtype))
    assert torch.isinf(out[~finite]).all()
    assert torch.equal(torch.signbit(out[~finite]), torch.signbit(ref[~finite]))


def test_quantize_dequantize_roundtrip_every_scale():
    packed = _all_codes_group_packed(255)
    scale = ALL_SCALES[:, None].clone()
    p2, s2 = quantize_mxfp4(dequantize_mxfp4(packed, scale, dtype=torch.float64))
    assert torch.equal(p2, packed) and torch.equal(s2, scale)
    # float32 path for the scales where every value is finite in float32
    p3, s3 = quantize_mxfp4(dequantize_mxfp4(packed[:253], scale[:253], dtype=torch.float32))
    assert torch.equal(p3, packed[:253]) and torch.equal(s3, scale[:253])


def test_quantize_is_idempotent_on_random_mxfp4_values():
    g = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (64, 48), generator=g, dtype=torch.uint8)
    scale = torch.randint(0, 255, (64, 3), generator=g, dtype=torch.uint8)
    x = dequantize_mxfp4(packed, scale, dtype=torch.float64)
    p2, s2 = quantize_mxfp4(x)
    _assert_identical(dequantize_mxfp4(p2, s2, dtype=torch.float64), x)
    p3, s3 = quantize_mxfp4(dequantize_mxfp4(p2, s2, dtype=torch.float64))
    assert torch.equal(p3, p2) and torch.equal(s3, s2)


def _codes_and_scale(x: torch.Tensor):
    packed, scale = quantize_mxfp4(x)
    return unpack_e2m1(packed), scale


def test_quantize_hand_worked_group():
    # amax = 12 -> floor(log2 12) = 3 -> e = 1 (byte 128); each x is rounded as x / 2.
    cases = [  # (x, expected code, dequantized value)
        (12.0, 7, 12.0),  # 6 exactly
        (5.0, 4, 4.0),  # 2.5: tie 2 (code 4, even) vs 3 -> 2
        (7.0, 6, 8.0),  # 3.5: tie 3 vs 4 (code 6, even) -> 4
        (-1.5, 10, -2.0),  # -0.75: tie 0.5 vs 1 (code 2, even) -> -1
        (0.5, 0, 0.0),  # 0.25: tie 0 (code 0) vs 0.5 -> 0
        (-0.5, 8, -0.0),  # -0.25 -> -0, sign kept
        (2.5, 2, 2.0),  # 1.25: tie 1 (code 2) vs 1.5 -> 1
        (3.5, 4, 4.0),  # 1.75: tie 1.5 vs 2 (code 4) -> 2
        (10.0, 6, 8.0),  # 5: tie 4 (code 6) vs 6 -> 4
        (11.0, 7, 12.0),  # 5.5 -> 6
        (9.0, 6, 8.0),  # 4.5 -> 4 (nearest)
        (0.6, 1, 1.0),  # 0.3 -> 0.5
        (-8.0, 14, -8.0),  # -4 exactly
        (-0.0, 8, -0.0),
        (0.0, 0, 0.0),
    ]
    xs = [c[0] for c in cases] + [0.0] * (GROUP_SIZE - len(cases))
    x = torch.tensor([xs], dtype=torch.float32)
    codes, scale = _codes_and_scale(x)
    assert scale.tolist() == [[128]]
    assert codes[0, : len(cases)].tolist() == [c[1] for c in cases]
    deq = dequantize_mxfp4(*quantize_mxfp4(x), dtype=torch.float32)[0, : len(cases)]
    _assert_identical(deq, torch.tensor([c[2] for c in cases], dtype=torch.float32))


def test_quantize_saturation_clamping_and_zero_groups():
    x = torch.zeros(6, GROUP_SIZE, dtype=torch.float64)
    x[0, :3] = torch.tensor([15.0, 14.0, -15.0])  # amax 15 -> e = 1; 7.5 and 7 saturate to 6
    x[1, 0] = 2.0**-120  # e = -122 -> byte 5
    x[2, 0] = 1e-300  # e would be -999: clamped to -127 (byte 0); value rounds to 0
    x[3, :2] = torch.tensor([2.0**200, -(2.0**190)], dtype=torch.float64)  # e would be 198: clamped to 127, saturate
    x[4, 1] = -0.0  # all-zero group -> byte 0, -0.0 keeps its sign
    x[5, 0] = -(2.0**-128)  # e clamped to -127; -2**-128 / 2**-127 = -0.5 -> code 9
    codes, scale = _codes_and_scale(x)
    assert scale[:, 0].tolist() == [128, 5, 0, 254, 0, 0]
    assert codes[0, :3].tolist() == [7, 7, 15]
    assert codes[1, 0] == 6  # 2**-120 / 2**-122 = 4 -> code 6
    assert codes[2, 0] == 0
    assert codes[3, :2].tolist() == [7, 15]  # +-6 * 2**127
    assert codes[4, :2].tolist() == [0, 8] and codes[4, 2:].eq(0).all()
    assert codes[5, 0] == 9
    deq = dequantize_mxfp4(*quantize_mxfp4(x), dtype=torch.float64)
    assert deq[0, :3].tolist() == [12.0, 12.0, -12.0]
    assert deq[3, :2].tolist() == [6 * 2.0**127, -6 * 2.0**127]


def test_quantize_scale_follows_floor_log2_rule_on_random_data():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 8 * GROUP_SIZE, generator=g) * torch.logspace(-30, 30, 16)[:, None]
    _, scale = quantize_mxfp4(x)
    amax = x.abs().reshape(16, 8, GROUP_SIZE).amax(-1).double()
    want = [[math.frexp(a)[1] - 1 - 2 + 127 for a in row] for row in amax.tolist()]
    assert scale.tolist() == want


def test_quantize_rounds_to_nearest_with_error_bound_on_gaussian_data():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(64, 256, generator=g, dtype=torch.float32) * 3.0
    packed, scale = quantize_mxfp4(x)
    deq = dequantize_mxfp4(packed, scale, dtype=torch.float32)
    step = e8m0_to_float(scale).repeat_interleave(GROUP_SIZE, dim=-1)  # 2**e per element
    y = x.abs() / step
    err = (x - deq).abs() / step  # error in units of 2**e (exact: power-of-two division)
    sat = y > 6
    # Half the E2M1 spacing: 0.5 below 2, 1 in [2, 4], 2 in [4, 6].
    bound = torch.where(y <= 2, 0.25, torch.where(y <= 4, 0.5, 1.0))
    assert (err[~sat] <= bound[~sat]).all()
    assert (err[~sat] <= 1.0).all() and err[~sat].max() > 0.5  # uniform bound 2**e is reached
    assert sat.any() and torch.equal(deq[sat].abs() / step[sat], torch.full_like(y[sat], 6.0))
    # Stronger: deq is the nearest grid point (no grid point is strictly closer).
    grid = E2M1_VALUES[:8][None, None, :] * step[..., None]
    nearest = (x.abs()[..., None] - grid).abs().amin(-1)
    assert torch.equal((x.abs() - deq.abs()).abs(), nearest)
    assert torch.equal(torch.signbit(deq), torch.signbit(x))


def test_float64_input_is_rounded_in_float64():
    x = torch.zeros(1, GROUP_SIZE, dtype=torch.float64)
    x[0, 0] = 6.0  # e = 0
    x[0, 1] = 2.5 + 2.0**-30  # just above the 2|3 tie: float64 -> 3 (code 5); float32 sees the tie -> 2
    codes64, _ = _codes_and_scale(x)
    codes32, _ = _codes_and_scale(x.float())
    assert codes64[0, 1] == 5 and codes32[0, 1] == 4
    assert dequantize_mxfp4(*quantize_mxfp4(x), dtype=torch.float64).dtype == torch.float64


def test_half_precision_input_matches_float32():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 128, generator=g).to(torch.bfloat16)
    for a, b in zip(quantize_mxfp4(x), quantize_mxfp4(x.float())):
        assert torch.equal(a, b)
    assert dequantize_mxfp4(*quantize_mxfp4(x)).dtype == torch.bfloat16  # default output dtype


def test_leading_batch_dims_match_per_slice_calls():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 5, 4 * GROUP_SIZE, generator=g)
    packed, scale = quantize_mxfp4(x)
    assert packed.shape == (3, 5, 64) and scale.shape == (3, 5, 4)
    for e in range(3):
        pe, se = quantize_mxfp4(x[e])
        assert torch.equal(packed[e], pe) and torch.equal(scale[e], se)
    deq = dequantize_mxfp4(packed, scale, dtype=torch.float32)
    assert deq.shape == x.shape
    for e in range(3):
        assert torch.equal(deq[e], dequantize_mxfp4(packed[e], scale[e], dtype=torch.float32))
    assert torch.equal(unpack_e2m1(packed)[1], unpack_e2m1(packed[1]))
    # non-contiguous input gives the same result as its contiguous copy
    xt = torch.randn(4 * GROUP_SIZE, 6, generator=g).t()
    assert all(torch.equal(a, b) for a, b in zip(quantize_mxfp4(xt), quantize_mxfp4(xt.contiguous())))


U8 = torch.uint8


@pytest.mark.parametrize(
    "call, exc, needles",
    [
        (lambda: quantize_mxfp4(torch.zeros(2, 48)), ValueError, ["48", "32"]),
        (lambda: quantize_mxfp4(torch.zeros(2, 64, dtype=torch.int32)), TypeError, ["torch.int32"]),
        (lambda: quantize_mxfp4(torch.tensor([[1.0] * 31 + [float("inf")]])), ValueError, ["inf", "(0, 31)"]),
        (lambda: quantize_mxfp4(torch.tensor([[float("nan")] + [1.0] * 31])), ValueError, ["nan", "(0, 0)"]),
        (lambda: dequantize_mxfp4(torch.zeros(2, 24, dtype=U8), torch.zeros(2, 1, dtype=U8)), ValueError, ["48"]),
        (lambda: dequantize_mxfp4(torch.zeros(2, 16, dtype=torch.int8), torch.zeros(2, 1, dtype=U8)), TypeError, ["torch.int8"]),
        (lambda: dequantize_mxfp4(torch.zeros(2, 16, dtype=U8), torch.zeros(2, 1)), TypeError, ["torch.float32"]),
        (lambda: dequantize_mxfp4(torch.zeros(4, 32, dtype=U8), torch.zeros(4, 3, dtype=U8)), ValueError, ["(4, 3)", "(4, 2)"]),
        (lambda: dequantize_mxfp4(torch.zeros(4, 32, dtype=U8), torch.zeros(5, 2, dtype=U8)), ValueError, ["(5, 2)", "(4, 2)"]),
        (lambda: dequantize_mxfp4(torch.zeros(2, 16, dtype=U8), torch.tensor([[7], [255]], dtype=U8)), ValueError, ["255", "(1, 0)"]),
        (lambda: dequantize_mxfp4(torch.zeros(2, 16, dtype=U8), torch.zeros(2, 1, dtype=U8), dtype=torch.int32), TypeError, ["torch.int32"]),
        (lambda: e8m0_to_float(torch.tensor([0, 255, 255], dtype=U8)), ValueError, ["255", "2 byte"]),
        (lambda: pack_e2m1(torch.tensor([1, 16], dtype=U8)), ValueError, ["16"]),
        (lambda: pack_e2m1(torch.zeros(3, dtype=U8)), ValueError, ["(3,)"]),
        (lambda: pack_e2m1(torch.zeros(4, dtype=torch.int64)), TypeError, ["torch.int64"]),
        (lambda: unpack_e2m1(torch.zeros(4, dtype=torch.int16)), TypeError, ["torch.int16"]),
    ],
)
def test_validation_errors(call, exc, needles):
    with pytest.raises(exc) as info:
        call()
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_check_scales_names_the_tensor():
    key = "model.layers.1.mlp.experts.3.w2.weight_scale"
    scale = torch.full((4, 3), 127, dtype=U8)
    mxfp4.check_scales(scale, name=f"tensor {key} in model-00001-of-00002.safetensors")  # no 255: accepted
    scale[2, 1] = scale[3, 0] = 255
    with pytest.raises(ValueError) as info:
        mxfp4.check_scales(scale, name=f"tensor {key} in model-00001-of-00002.safetensors")
    assert str(info.value) == (f"tensor {key} in model-00001-of-00002.safetensors: scale contains 2 byte(s) equal "
                               "to 255 (E8M0 NaN, reserved), first at index (2, 1); expected bytes in 0..254")
    with pytest.raises(ValueError) as info:
        mxfp4.check_scales(scale)
    assert str(info.value).startswith("scale contains 2 byte(s) equal to 255")
    with pytest.raises(TypeError, match=f"^tensor {key} must have dtype torch.uint8"):
        mxfp4.check_scales(scale.float(), name=f"tensor {key}")


def test_dequantize_overflow_logs_warning(caplog):
    packed = _all_codes_group_packed(1)
    with caplog.at_level("WARNING", logger=mxfp4.__name__):
        dequantize_mxfp4(packed, torch.tensor([[254]], dtype=U8), dtype=torch.float32)
    assert "overflow" in caplog.text


def _import_compressed_tensors():
    try:
        from compressed_tensors.compressors.mx_utils import decompress_mx_scale
        from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    except Exception as err:  # e.g. a missing triton dependency on this CPU box
        pytest.skip(f"compressed-tensors helpers not importable here: {type(err).__name__}: {err}")
    return unpack_fp4_from_uint8, decompress_mx_scale


def test_cross_check_compressed_tensors_unpack_and_scale():
    unpack_fp4_from_uint8, decompress_mx_scale = _import_compressed_tensors()
    g = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (32, 64), generator=g, dtype=U8)
    theirs = unpack_fp4_from_uint8(packed, 32, 128, dtype=torch.float32)
    _assert_identical(theirs, E2M1_VALUES[unpack_e2m1(packed).long()])
    scale = torch.cat((ALL_SCALES, torch.randint(0, 255, (257,), generator=g, dtype=U8))).reshape(32, 16)
    _assert_identical(decompress_mx_scale(scale), e8m0_to_float(scale, torch.bfloat16))
    # Whole-format agreement: their unpack times their scale equals our dequantize.
    scale = torch.randint(100, 155, (32, 4), generator=g, dtype=U8)
    theirs = theirs.reshape(32, 4, 32) * decompress_mx_scale(scale).float()[..., None]
    _assert_identical(theirs.reshape(32, 128), dequantize_mxfp4(packed, scale, dtype=torch.float32))


def test_fused_dequantization_is_bit_identical_for_every_byte_and_scale():
    from modelopt_ext.formats.mxfp4 import dequantize_mxfp4, dequantize_mxfp4_fused

    packed = torch.arange(256, dtype=torch.uint8).repeat(255, 1).view(255, 16, 16)  # every byte, every row
    scale = torch.arange(255, dtype=torch.uint8).view(255, 1).repeat(1, 16).view(255, 16, 1)  # scales 0..254
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        want = dequantize_mxfp4(packed, scale, dtype, validate=False)
        got = dequantize_mxfp4_fused(packed, scale, dtype)
        assert got.dtype == dtype
        assert torch.equal(got.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           want.view(torch.int16 if dtype != torch.float32 else torch.int32))
