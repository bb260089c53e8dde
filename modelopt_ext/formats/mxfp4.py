"""OCP Microscaling MXFP4 as stored by compressed-tensors ``mxfp4-pack-quantized``.

Elements are FP4 E2M1 codes (bit 3 = sign, bits 0-2 index ``[0, .5, 1, 1.5, 2, 3, 4, 6]``),
packed two per uint8 with the LOW nibble first. Every ``GROUP_SIZE`` consecutive elements
along the last dim share one uint8 E8M0 scale ``2 ** (s - 127)``; ``s = 255`` (NaN) is refused.

Shape legend (any number of leading batch dims ``...`` is allowed, e.g. experts ``E``):
    C  elements along the last dim (a multiple of 32)
    B  packed bytes, ``C // 2``
    G  scale groups, ``C // 32``
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

GROUP_SIZE = 32
SCALE_BIAS = 127
E2M1_MAX_EXP = 2  # floor(log2(6)), the largest E2M1 exponent
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
# Midpoints between consecutive E2M1 magnitudes; midpoint k separates codes k and k+1.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _require_uint8(name: str, t: torch.Tensor) -> None:
    if t.dtype != torch.uint8:
        raise TypeError(f"{name} must have dtype torch.uint8, got {t.dtype}")


def _check_group_multiple(c: int) -> None:
    if c % GROUP_SIZE != 0:
        raise ValueError(f"last dimension {c} is not a multiple of the MXFP4 group size {GROUP_SIZE}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack E2M1 codes two per byte, low nibble first.

    Args:
        codes: uint8 ``[..., C]`` with values in 0..15 and ``C`` even.
    Returns:
        uint8 ``[..., C // 2]`` where ``byte[j] = code[2j] | code[2j+1] << 4``.
    """
    _require_uint8("codes", codes)
    if codes.ndim == 0 or codes.shape[-1] % 2 != 0:
        raise ValueError(f"codes last dimension must be even, got shape {tuple(codes.shape)}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError(f"E2M1 codes must be in 0..15, got {int(codes.max())}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """Split each byte into two E2M1 codes, low nibble first.

    Args:
        packed: uint8 ``[..., B]``.
    Returns:
        uint8 codes ``[..., 2 * B]``.
    """
    _require_uint8("packed", packed)
    if packed.ndim == 0:
        raise ValueError("packed must have at least one dimension, got a scalar")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def check_scales(scale: torch.Tensor, name: str | None = None) -> None:
    """Refuse the E8M0 NaN byte 255 (one host sync: do it once per tensor, not per GEMM).

    Args:
        scale: uint8 ``[...]`` E8M0 bytes.
        name: what the message calls the tensor (its checkpoint key and file, say); "scale" if None.
    """
    _require_uint8(name or "scale", scale)
    bad = scale == 255
    if bool(bad.any()):
        first = tuple(torch.nonzero(bad)[0].tolist())
        raise ValueError(
            f"{name + ': ' if name else ''}scale contains {int(bad.sum())} byte(s) equal to 255 (E8M0 NaN, reserved), "
            f"first at index {first}; expected bytes in 0..254"
        )


def e8m0_to_float(scale: torch.Tensor, dtype: torch.dtype = torch.float32, validate: bool = True) -> torch.Tensor:
    """Decode E8M0 scale bytes to ``2 ** (s - 127)``, exactly (built from float64 bits).

    Args:
        scale: uint8 ``[...]``; the NaN byte 255 is refused when ``validate``.
        dtype: output dtype (values outside its range become 0 or inf on the cast).
        validate: check for byte 255 (a host sync); pass False on hot paths whose scales were checked
            once with ``check_scales``.
    Returns:
        ``[...]`` tensor of powers of two in ``dtype``.
    """
    _require_uint8("scale", scale)
    if validate:
        check_scales(scale)
    # float64 exponent field = (s - 127) + 1023 is always a normal number for s in 0..254.
    bits_f64 = (scale.to(torch.int64) + (1023 - SCALE_BIAS)) << 52
    return bits_f64.view(torch.float64).to(dtype)


def e2m1_magnitude_codes(y: torch.Tensor) -> torch.Tensor:
    """int64 E2M1 magnitude codes 0..7 of |values| `y`: the nearest E2M1 magnitude, ties to the even code,
    saturating at 6."""
    mids = torch.tensor(_MIDPOINTS + (float("inf"),), dtype=y.dtype, device=y.device)
    idx = torch.bucketize(y, mids[:-1])  # number of midpoints strictly below y
    tie_up = (y == mids[idx]) & (idx % 2 == 1)  # tie: go up only if code idx+1 is even
    return idx + tie_up.to(idx.dtype)  # values above 5 land on 7 (6.0): saturation


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize to MXFP4 with the OCP MX rule (float32 math, float64 for float64 input).

    Per group: ``e = clamp(floor(log2(amax)) - 2, -127, 127)`` (``-127`` for an all-zero
    group); ``x / 2**e`` is rounded to the nearest E2M1 magnitude, ties to the even code
    (mantissa bit 0), saturating at 6. The sign of ``x`` is always kept, so ``-0.0`` and
    negatives that round to zero become code 8 (``-0.0``).

    Args:
        weight: floating ``[..., C]``, finite, ``C`` a multiple of 32.
    Returns:
        ``(packed_B, scale_G)``: uint8 ``[..., C // 2]`` and uint8 ``[..., C // 32]``.
    """
    if not weight.is_floating_point():
        raise TypeError(f"weight must be a floating-point tensor, got {weight.dtype}")
    if weight.ndim == 0:
        raise ValueError("weight must have at least one dimension, got a scalar")
    _check_group_multiple(weight.shape[-1])
    finite = torch.isfinite(weight)
    if not bool(finite.all()):
        first = tuple(torch.nonzero(~finite)[0].tolist())
        raise ValueError(
            f"weight contains {int((~finite).sum())} non-finite value(s), first "
            f"{weight[first].item()} at index {first}; expected only finite values"
        )
    wd = _compute_dtype(weight.dtype)
    lead, c = weight.shape[:-1], weight.shape[-1]
    x_GK = weight.to(wd).reshape(*lead, c // GROUP_SIZE, GROUP_SIZE).contiguous()
    amax_G = x_GK.abs().amax(dim=-1)
    _, exp_G = torch.frexp(amax_G)  # amax = m * 2**exp, m in [0.5, 1) -> floor(log2) = exp - 1
    e_G = (exp_G.to(torch.int64) - 1 - E2M1_MAX_EXP).clamp(-SCALE_BIAS, SCALE_BIAS)
    e_G = torch.where(amax_G == 0, torch.full_like(e_G, -SCALE_BIAS), e_G)
    scale_G = (e_G + SCALE_BIAS).to(torch.uint8)
    inv_G = e8m0_to_float((SCALE_BIAS - e_G).to(torch.uint8), wd)  # 2**-e, exact power of two
    mag_GK = e2m1_magnitude_codes((x_GK * inv_G.unsqueeze(-1)).abs())  # exact: scaling by a power of two
    codes_GK = mag_GK.to(torch.uint8) | (torch.signbit(x_GK).to(torch.uint8) << 3)
    logger.debug("quantized MXFP4 weight of shape %s", tuple(weight.shape))
    return pack_e2m1(codes_GK.reshape(*lead, c)), scale_G


_TABLES: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _e2m1_table(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """E2M1_VALUES on `device`, copied once: a host-to-device copy per call would synchronise the stream."""
    key = (device, dtype)
    if key not in _TABLES:
        _TABLES[key] = E2M1_VALUES.to(device=device, dtype=dtype)
    return _TABLES[key]


def dequantize_mxfp4(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16, validate: bool = True
) -> torch.Tensor:
    """Decode MXFP4: ``E2M1_VALUES[code] * 2 ** (s - 127)``.

    Computed in float32 (float64 when ``dtype`` is float64), then cast to ``dtype``.

    Args:
        packed: uint8 ``[..., B]`` (``2 * B`` a multiple of 32).
        scale: uint8 ``[..., 2 * B // 32]``, same leading dims as ``packed``.
        dtype: floating output dtype.
        validate: refuse scale byte 255 and warn on overflow (host syncs); False on hot paths whose
            scales were checked once with ``check_scales``.
    Returns:
        ``[..., 2 * B]`` tensor in ``dtype``.
    """
    _require_uint8("packed", packed)
    _require_uint8("scale", scale)
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point dtype, got {dtype}")
    if packed.ndim == 0:
        raise ValueError("packed must have at least one dimension, got a scalar")
    c = 2 * packed.shape[-1]
    _check_group_multiple(c)
    want = (*packed.shape[:-1], c // GROUP_SIZE)
    if tuple(scale.shape) != want:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match packed shape {tuple(packed.shape)}: "
            f"packed [..., {packed.shape[-1]}] needs scale [..., {c // GROUP_SIZE}], i.e. {want}"
        )
    wd = _compute_dtype(dtype)
    vals_C = _e2m1_table(packed.device, wd)[unpack_e2m1(packed).long()]
    vals_GK = vals_C.reshape(*want, GROUP_SIZE) * e8m0_to_float(scale, wd, validate).unsqueeze(-1)
    out = vals_GK.reshape(*packed.shape[:-1], c).to(dtype)
    if validate and not bool(torch.isfinite(out).all()):
        logger.warning("MXFP4 dequantization overflowed %s; some values are inf", dtype)
    return out


def _dequantize_body(packed: torch.Tensor, scale: torch.Tensor, table: torch.Tensor, dtype: torch.dtype):
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2).long()
    s = scale.to(torch.int32)
    # 2 ** (s - 127) as float32 bits: the exponent field is s for s >= 1; s == 0 is the subnormal 2 ** -127.
    pow2 = torch.where(s == 0, 1 << 22, s << 23).view(torch.float32)
    vals = table[codes].view(*scale.shape, GROUP_SIZE) * pow2.unsqueeze(-1)
    return vals.flatten(-2).to(dtype)


def dequantize_mxfp4_fused(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16):
    """`dequantize_mxfp4(..., validate=False)` for the hot path, bit-identical: on CUDA one Triton kernel
    (`kernels.mxfp4`) that reads the packed bytes and scales once and writes `dtype` (the reference goes
    through float64 scales and several full-size temporaries); elsewhere the same float32 arithmetic in torch.
    Scales must have been checked with `check_scales`; shapes are not re-validated here."""
    if dtype == torch.float64:
        return dequantize_mxfp4(packed, scale, dtype, validate=False)
    if packed.is_cuda and dtype in (torch.bfloat16, torch.float16, torch.float32):
        from modelopt_ext.kernels.mxfp4 import dequantize

        return dequantize(packed, scale, dtype)
    return _dequantize_body(packed, scale, _e2m1_table(packed.device, torch.float32), dtype)
