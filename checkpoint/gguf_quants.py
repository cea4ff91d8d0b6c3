"""Dequantizing GGUF (ggml) tensor data to float32 with numpy.

Written from ggml's block layouts (ggml-common.h, ggml-quants.c). All multi-byte
fields are little-endian. A quantized row is a run of blocks; each block holds
`block_size` elements in `type_size` bytes. Every function here works on all the
blocks of a tensor at once: raw bytes are viewed as [n_blocks, type_size] and
unpacked with array ops, never with a Python loop per block.
"""
from __future__ import annotations

import numpy as np

GGML_TYPES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
    22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4",
}

QK_K = 256  # elements in a K-quant super-block

# type name -> (block_size elements, type_size bytes), as in ggml's type traits.
_SIZES: dict[str, tuple[int, int]] = {
    "F32": (1, 4), "F16": (1, 2), "BF16": (1, 2), "F64": (1, 8),
    "I8": (1, 1), "I16": (1, 2), "I32": (1, 4), "I64": (1, 8),
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q8_0": (32, 34), "Q8_1": (32, 40),
    "Q2_K": (QK_K, 84), "Q3_K": (QK_K, 110), "Q4_K": (QK_K, 144), "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210), "Q8_K": (QK_K, 292),
    "IQ2_XXS": (QK_K, 66), "IQ2_XS": (QK_K, 74), "IQ3_XXS": (QK_K, 98), "IQ1_S": (QK_K, 50),
    "IQ4_NL": (32, 18), "IQ3_S": (QK_K, 110), "IQ2_S": (QK_K, 82), "IQ4_XS": (QK_K, 136),
    "IQ1_M": (QK_K, 56), "TQ1_0": (QK_K, 54), "TQ2_0": (QK_K, 66), "MXFP4": (32, 17),
}


def _name(type_id: int) -> str:
    return GGML_TYPES.get(type_id, "unknown")


def block_size(type_id: int) -> int:
    """Elements per block (1 for plain float and int types)."""
    return _sizes(type_id)[0]


def _sizes(type_id: int) -> tuple[int, int]:
    sizes = _SIZES.get(GGML_TYPES.get(type_id, ""))
    if sizes is None:
        raise ValueError(f"GGUF tensor type {_name(type_id)} ({type_id}) has no known block size")
    return sizes


def nbytes(type_id: int, num_elements: int) -> int:
    """Bytes a tensor of `num_elements` elements of this ggml type occupies.

    Known for every type in GGML_TYPES (also those `dequantize` cannot read), so
    a loader can size any tensor. `num_elements` must fill whole blocks.
    """
    bs, ts = _sizes(type_id)
    if num_elements < 0 or num_elements % bs:
        raise ValueError(
            f"{num_elements} elements do not fill whole {_name(type_id)} blocks of {bs}"
        )
    return num_elements // bs * ts


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The little-endian f16 at byte `start` of each block, as float32 [n_blocks, 1]."""
    return blocks[:, start:start + 2].view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., k] bytes -> [..., 2, k] uint8: low nibbles, then high nibbles."""
    return np.stack([qs & 0x0F, qs >> 4], axis=-2)


def _f32(raw: np.ndarray) -> np.ndarray:
    return raw.view("<f4").astype(np.float32)  # astype copies: the result is always writable


def _f16_plain(raw: np.ndarray) -> np.ndarray:
    return raw.view("<f2").astype(np.float32)


def _bf16(raw: np.ndarray) -> np.ndarray:
    """bfloat16 is the top half of a float32: shift the 16 bits up and reinterpret."""
    return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q8_0, 32 elements in 34 bytes: f16 d, then 32 int8 q. value = q * d."""
    q = blocks[:, 2:].view(np.int8).astype(np.float32)  # [n, 32]
    q *= _f16(blocks, 0)
    return q


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    """Q4_0, 32 elements in 18 bytes: f16 d, then 16 bytes qs.

    Byte j holds element j in its low nibble and element j + 16 in its high one.
    value = (nibble - 8) * d.
    """
    q = _nibbles(blocks[:, 2:]).reshape(-1, 32).astype(np.float32)  # [n, 32]
    q -= 8.0
    q *= _f16(blocks, 0)
    return q


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    """Q4_1, 32 elements in 20 bytes: f16 d, f16 m, then 16 bytes qs (nibbles as Q4_0).

    value = nibble * d + m.
    """
    q = _nibbles(blocks[:, 4:]).reshape(-1, 32).astype(np.float32)  # [n, 32]
    q *= _f16(blocks, 0)
    q += _f16(blocks, 2)
    return q


def _k4_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4).

    Bytes 0-3: scales 0-3 in bits 0-5, top 2 bits of scales 4-7 in bits 6-7.
    Bytes 4-7: mins 0-3 in bits 0-5, top 2 bits of mins 4-7 in bits 6-7.
    Bytes 8-11: low 4 bits of scales 4-7 in bits 0-3, of mins 4-7 in bits 4-7.
    """
    a, b, c = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]  # [n, 4] each
    scales = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=1)  # [n, 8]
    mins = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=1)  # [n, 8]
    return scales, mins


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    """Q4_K, 256 elements in 144 bytes: f16 d, f16 dmin, 12 bytes scales, 128 bytes qs.

    Eight sub-blocks of 32, each with a 6-bit scale sc and min m (see
    _k4_scales_mins). qs is four runs of 32 bytes; run i holds sub-block 2i in its
    low nibbles and sub-block 2i + 1 in its high ones.
    value = (d * sc) * nibble - (dmin * m).
    """
    n = blocks.shape[0]
    scales, mins = _k4_scales_mins(blocks[:, 4:16])
    step = (_f16(blocks, 0) * scales)[:, :, None]  # [n, 8, 1]
    offset = (_f16(blocks, 2) * mins)[:, :, None]  # [n, 8, 1]
    q = _nibbles(blocks[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).astype(np.float32)
    q *= step
    q -= offset
    return q.reshape(n, QK_K)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    """Q6_K, 256 elements in 210 bytes: 128 bytes ql, 64 bytes qh, 16 int8 scales, f16 d.

    Each half of 128 elements uses 64 bytes of ql and 32 of qh. Within a half,
    element 32k + l (k = 0..3, l = 0..31) takes its low 4 bits from
    ql[l + 32 * (k % 2)] (low nibble for k < 2, high for k >= 2) and its top 2
    bits from bits 2k..2k+1 of qh[l]. Scale j covers elements 16j..16j+15.
    value = (d * scale) * (q6 - 32).
    """
    n = blocks.shape[0]
    ql = _nibbles(blocks[:, :128].reshape(n, 2, 64))  # [n, half, lo/hi nibble, 64]
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)  # [n, half, 1, 32]
    qh = (qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 0x03  # [n, half, k, 32]
    q = (ql.reshape(n, 2, 4, 32) | (qh << 4)).view(np.int8) - np.int8(32)  # [n, 2, 4, 32]
    q = q.reshape(n, 16, 16).astype(np.float32)
    step = _f16(blocks, 208) * blocks[:, 192:208].view(np.int8)  # [n, 16]
    q *= step[:, :, None]
    return q.reshape(n, QK_K)


_PLAIN = {"F32": _f32, "F16": _f16_plain, "BF16": _bf16}
_BLOCKED = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k}
SUPPORTED = tuple(_PLAIN) + tuple(_BLOCKED)


def dequantize(
    data: np.ndarray | bytes | memoryview, type_id: int, shape: tuple[int, ...]
) -> np.ndarray:
    """Raw GGUF tensor bytes -> a new float32 array of `shape`.

    `shape` is in numpy (row-major) order: the last dim is the contiguous one, a
    multiple of the block size for quantized types. (GGUF headers list dims
    innermost first; reverse them before calling.) `data` is exactly the
    tensor's bytes, as bytes, a memoryview, or a numpy array of any dtype.
    """
    name = _name(type_id)
    if name not in SUPPORTED:
        raise ValueError(
            f"GGUF tensor type {name} ({type_id}) is not supported; "
            f"supported: {', '.join(SUPPORTED)}"
        )
    shape = tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise ValueError(f"invalid tensor shape {shape}")
    bs, ts = _SIZES[name]
    if shape and shape[-1] % bs:
        raise ValueError(f"{name} rows must be a multiple of {bs} elements; shape is {shape}")
    numel = int(np.prod(shape, dtype=np.int64))
    if isinstance(data, np.ndarray):
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    else:
        raw = np.frombuffer(data, dtype=np.uint8)
    expected = nbytes(type_id, numel)
    if raw.size != expected:
        raise ValueError(
            f"{name} tensor of shape {shape} needs {expected} bytes, got {raw.size}"
        )
    if name in _PLAIN:
        out = _PLAIN[name](raw)
    else:
        out = _BLOCKED[name](raw.reshape(-1, ts))
    return out.reshape(shape)
