"""DeepSeek-V3's 128x128-block FP8 format (modelopt_ext.formats.fp8_block), and the partial-block bug of
transformers 5.25's CPU dequantization that `exact_block_dequantize` fixes."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.finegrained_fp8 import Fp8Dequantize
from transformers.utils.quantization_config import FineGrainedFP8Config

from modelopt_ext.formats import fp8_block as fp8


def _weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))


def _op() -> Fp8Dequantize:
    class Quantizer:  # what Fp8Dequantize reads of transformers' FP8 quantizer
        quantization_config = FineGrainedFP8Config(weight_block_size=[128, 128], dequantize=True)

    return Fp8Dequantize(Quantizer())


@pytest.mark.parametrize("shape, scales", [((576, 7168), (5, 56)), ((192, 256), (2, 2)), ((256, 128), (2, 1)),
                                           ((7168, 16384), (56, 128)), ((5, 3), (1, 1))])
def test_scale_shape_is_the_ceil_divided_block_grid(shape, scales):
    assert fp8.scale_shape(*shape) == scales


def test_quantize_blocks_scales_each_block_by_its_amax():
    w = _weight(192, 256)
    w[:128, 128:] = 0  # an all-zero block gets scale 1
    q, s = fp8.quantize_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (192, 256)
    assert s.dtype == torch.float32 and s.shape == (2, 2)
    assert s[0, 1] == 1
    for r, c in [(0, 0), (1, 0), (1, 1)]:  # the partial row block (64 rows) is scaled by its own 64 x 128 amax
        block = w[128 * r:128 * (r + 1), 128 * c:128 * (c + 1)]
        assert s[r, c] == block.abs().max() / 448
        assert q[128 * r:128 * (r + 1), 128 * c:128 * (c + 1)].float().abs().max() == 448


def test_dequantize_blocks_is_the_weight_within_e4m3_rounding():
    w = _weight(192, 256, seed=1)
    q, s = fp8.quantize_blocks(w)
    dq = fp8.dequantize_blocks(q, s)
    assert dq.dtype == torch.float32 and dq.shape == w.shape
    # E4M3: 3 mantissa bits (half an ulp: 2^-4 relative), subnormal spacing 2^-9 below 2^-6 (times the scale)
    bound = w.abs() * 2**-4 + fp8.expand_scales(s, w.shape) * 2**-10
    assert ((dq - w).abs() <= bound).all()
    assert torch.equal(fp8.dequantize_blocks(q, s, torch.bfloat16), dq.to(torch.bfloat16))


def test_expand_scales_refuses_a_grid_that_does_not_cover_the_weight():
    with pytest.raises(ValueError, match=r"do not cover a weight \(192, 256\).*expected \(2, 2\)"):
        fp8.expand_scales(torch.ones(3, 2), (192, 256))


def test_transformers_alone_cannot_dequantize_the_real_kv_a_proj():
    """DeepSeek-V3 / Kimi-K2 `kv_a_proj_with_mqa`: [576, 7168] with [5, 56] scales (576 = 4 x 128 + 64)."""
    q = torch.zeros(576, 7168, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="not divisible by scale grid"):
        _op()._dequantize_one(q, torch.ones(5, 56))
    with fp8.exact_block_dequantize():
        out = _op()._dequantize_one(q, torch.ones(5, 56), output_dtype=torch.bfloat16)
    assert out.shape == (576, 7168) and out.dtype == torch.bfloat16


def test_transformers_alone_misreads_an_evenly_dividing_partial_block():
    """[192, 256] with [2, 2] scales: transformers reads two 96-row blocks, so rows 96..127 get the second
    block's scale. If this starts failing, transformers has fixed it and `exact_block_dequantize` can go."""
    q = torch.ones(192, 256).to(torch.float8_e4m3fn)
    scales = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    plain = _op()._dequantize_one(q, scales, output_dtype=torch.float32)
    assert plain[96:128, 0].unique().tolist() == [3.0]
    with fp8.exact_block_dequantize():
        exact = _op()._dequantize_one(q, scales, output_dtype=torch.float32)
    assert exact[:128, 0].unique().tolist() == [1.0] and exact[128:, 0].unique().tolist() == [3.0]
    assert exact[:128, 128:].unique().tolist() == [2.0] and exact[128:, 128:].unique().tolist() == [4.0]


def test_the_scope_matches_transformers_bit_for_bit_on_whole_blocks():
    q, s = fp8.quantize_blocks(_weight(256, 384, seed=2))
    plain = _op()._dequantize_one(q, s, output_dtype=torch.bfloat16)
    default_dtype = _op()._dequantize_one(q, s)
    with fp8.exact_block_dequantize():
        assert torch.equal(_op()._dequantize_one(q, s, output_dtype=torch.bfloat16), plain)
        assert torch.equal(_op()._dequantize_one(q, s), default_dtype)
    assert torch.equal(plain, fp8.dequantize_blocks(q, s, torch.bfloat16))


def test_the_scope_leaves_other_formats_to_transformers():
    """A [1, 32]-block grid (MXFP4-style scales) is not a 128x128 grid of the weight: transformers' code runs."""
    q = torch.ones(4, 64).to(torch.float8_e4m3fn)
    scales = torch.full((4, 2), 2.0)
    with fp8.exact_block_dequantize():
        out = _op()._dequantize_one(q, scales, output_dtype=torch.float32)
    assert out.unique().tolist() == [2.0]


def test_the_scope_nests_and_restores_transformers_function():
    original = Fp8Dequantize._dequantize_one
    with fp8.exact_block_dequantize():
        patched = Fp8Dequantize._dequantize_one
        assert patched is not original
        with fp8.exact_block_dequantize():
            assert Fp8Dequantize._dequantize_one is patched
        assert Fp8Dequantize._dequantize_one is patched
    assert Fp8Dequantize._dequantize_one is original
    with pytest.raises(RuntimeError), fp8.exact_block_dequantize():
        raise RuntimeError("boom")
    assert Fp8Dequantize._dequantize_one is original


def test_the_scope_restores_transformers_shard_on_read():
    from transformers.distributed.sharding_utils import DtensorShardOperation

    init, shard = DtensorShardOperation.__init__, DtensorShardOperation.shard_tensor
    with fp8.exact_block_dequantize(), fp8.exact_block_dequantize():
        assert DtensorShardOperation.__init__ is not init and DtensorShardOperation.shard_tensor is not shard
    assert DtensorShardOperation.__init__ is init and DtensorShardOperation.shard_tensor is shard


# ---- sharded loads (FSDP dense layers): each rank's scales are its weight shard's -----------------------------------


@pytest.mark.parametrize("rows, cols", [(slice(None), slice(None)), (slice(192, 384), slice(None)),
                                        (slice(96, 192), slice(100, 200)), (slice(None), slice(200, 300)),
                                        (slice(130, 131), slice(5, 7)), (slice(0, 0), slice(None))])
def test_a_shards_scales_dequantize_to_its_part_of_the_whole_weight(rows, cols):
    """[576, 300]: a partial last block along both dimensions; shards that start and end inside blocks."""
    q, s = fp8.quantize_blocks(_weight(576, 300, seed=4))
    whole = fp8.dequantize_blocks(q, s, torch.bfloat16)
    scales = fp8.shard_block_scales(s, torch.arange(576)[rows], torch.arange(300)[cols], (576, 300))
    with fp8.exact_block_dequantize():
        got = _op()._dequantize_one(q[rows, cols], scales, output_dtype=torch.bfloat16)
    assert torch.equal(got, whole[rows, cols])
    if rows == slice(None) and cols == slice(None):
        assert scales is s  # a shard that holds the whole weight keeps the grid


def test_shard_block_scales_refuses_a_grid_of_another_weight():
    with pytest.raises(ValueError, match=r"scales \(5, 3\) do not cover a weight \(576, 200\)"):
        fp8.shard_block_scales(torch.ones(5, 3), torch.arange(10), torch.arange(200), (576, 200))


def shard_on_read(rank: int, world_size: int) -> dict[str, object]:
    """Per rank: transformers' shard-on-read of an FP8 weight and its scale grid for a [576, 300] parameter sharded
    along rows, then columns, dequantized as transformers pairs them; whether the result is this rank's part of the
    whole weight's dequantization, in the scope and without it (the name of the error transformers raised)."""
    import contextlib

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from transformers.distributed.sharding_utils import DtensorShardOperation

    mesh = init_device_mesh("cpu", (world_size,))
    q, s = fp8.quantize_blocks(_weight(576, 300, seed=4))
    whole = fp8.dequantize_blocks(q, s, torch.bfloat16)
    out = {}
    for dim in (0, 1):
        param = distribute_tensor(torch.zeros(576, 300, dtype=torch.bfloat16), mesh, [Shard(dim)])
        expected = distribute_tensor(whole, mesh, [Shard(dim)]).to_local()
        for scoped in (True, False):
            try:
                with fp8.exact_block_dequantize() if scoped else contextlib.nullcontext():
                    op = DtensorShardOperation(param)
                    got = _op()._dequantize_one(op.shard_tensor(q), op.shard_tensor(s), output_dtype=torch.bfloat16)
                out[f"dim{dim}_{'scope' if scoped else 'transformers'}"] = bool(torch.equal(got, expected))
            except Exception as e:  # noqa: BLE001
                out[f"dim{dim}_{'scope' if scoped else 'transformers'}"] = type(e).__name__
    return out


def test_shard_on_read_in_the_scope_gives_each_rank_its_part_of_the_dequantized_weight():
    """3 gloo ranks: rows 0-191, 192-383, 384-575 (blocks cut at 128 and 256...) and columns 0-99, 100-199,
    200-299. transformers alone cuts the [5, 3] grid by the same placement (rows 0-1, 2-3, 4 of it) and then
    fails or mis-scales; the scope matches the whole weight's bytes on every rank."""
    from modelopt_ext.testing.multiproc import run_ranks

    results = run_ranks(shard_on_read, 3, timeout_s=120)
    for r in results:
        assert r["dim0_scope"] is True and r["dim1_scope"] is True, results
    assert any(r[k] is not True for r in results for k in ("dim0_transformers", "dim1_transformers")), results
