"""GGUF dequantization against the gguf package's reference implementation."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as ref_dequantize
from gguf.quants import quantize as ref_quantize

from headrace.checkpoint.gguf_quants import GGML_TYPES, SUPPORTED, dequantize, nbytes

# type -> byte offsets of the f16 scale fields within a block
F16_FIELDS = {T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q4_K: [0, 2], T.Q6_K: [208]}
BLOCK_SHAPES = [(T.Q8_0, (3, 512)), (T.Q4_0, (3, 512)), (T.Q4_1, (3, 512)),
                (T.Q4_K, (2, 256)), (T.Q4_K, (3, 512)), (T.Q6_K, (2, 256)), (T.Q6_K, (3, 512))]


def random_blocks(qtype: T, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random block bytes [rows, row_bytes] with finite, moderate f16 scale fields."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        scale = rng.uniform(-2.0, 2.0, size=(n_blocks, 1)).astype(np.float16)
        raw[:, off:off + 2] = scale.view(np.uint8)
    return raw.reshape(shape[0], -1)


@pytest.mark.parametrize("qtype,shape", BLOCK_SHAPES, ids=lambda v: getattr(v, "name", str(v)))
def test_blocks_match_reference(qtype, shape):
    raw = random_blocks(qtype, shape, seed=int(qtype))
    expected = ref_dequantize(raw, qtype)
    assert expected.shape == shape
    for data in (raw, raw.tobytes(), memoryview(raw.tobytes())):
        got = dequantize(data, int(qtype), shape)
        assert got.dtype == np.float32 and got.shape == shape
        np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16])
def test_plain_floats_match_reference(qtype):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 40)).astype(np.float32)
    if qtype == T.BF16:
        raw = (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    else:
        raw = x.astype(np.float16 if qtype == T.F16 else np.float32).view(np.uint8)
    expected = ref_dequantize(raw, qtype).reshape(3, 40)
    got = dequantize(raw.tobytes(), int(qtype), (3, 40))
    assert got.dtype == np.float32 and got.flags.writeable
    np.testing.assert_array_equal(got, expected)
    # A typed array is taken as its bytes.
    typed = raw.view(np.float16 if qtype != T.F32 else np.float32)
    np.testing.assert_array_equal(dequantize(typed, int(qtype), (3, 40)), expected)


# Largest error per element, as a fraction of the block's largest |x|: half a step
# for round-to-nearest (a whole one where Q4_0 clips its top level), plus f16
# rounding of the scales.
@pytest.mark.parametrize("qtype,tol", [(T.Q8_0, 0.5 / 127), (T.Q4_0, 1 / 8), (T.Q4_1, 1 / 15)])
def test_round_trip(qtype, tol):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    q = ref_quantize(x, qtype)
    got = dequantize(q, int(qtype), x.shape)
    block_max = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True)  # [blocks, 1]
    err = np.abs(got - x).reshape(-1, 32)  # [blocks, 32]
    assert (err <= (tol + 2.0**-9) * block_max).all()
    np.testing.assert_array_equal(got, ref_dequantize(q, qtype))


def test_nbytes_matches_reference():
    for qtype, (block, size) in GGML_QUANT_SIZES.items():
        if int(qtype) not in GGML_TYPES:
            continue  # types newer than our table
        assert GGML_TYPES[int(qtype)] == qtype.name
        assert nbytes(int(qtype), 7 * block) == 7 * size, qtype.name
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"):
        assert name in SUPPORTED


def test_nbytes_errors():
    with pytest.raises(ValueError, match="Q4_K"):
        nbytes(int(T.Q4_K), 100)
    with pytest.raises(ValueError, match=r"unknown \(99\)"):
        nbytes(99, 32)


@pytest.mark.parametrize("type_id,name", [(13, "Q5_K"), (16, "IQ2_XXS"), (99, "unknown")])
def test_unsupported_type(type_id, name):
    with pytest.raises(ValueError, match=rf"{name} \({type_id}\) is not supported; supported: F32"):
        dequantize(b"\0" * 4096, type_id, (1, 256))


def test_bad_input():
    raw = random_blocks(T.Q4_0, (1, 64))
    with pytest.raises(ValueError, match="needs 36 bytes, got 35"):
        dequantize(raw.tobytes()[:-1], int(T.Q4_0), (1, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        dequantize(raw, int(T.Q4_0), (4, 16))
    with pytest.raises(ValueError, match="invalid tensor shape"):
        dequantize(raw, int(T.Q4_0), (-1, 64))
