"""Hostile GGUF files fail fast, small and by name; a very long vocabulary token builds in linear memory.

The files are written here, most of them a few hundred bytes. The two inputs that used to take
gigabytes (a 100,000-character token; ``block_count = 10**9``) run in a child process under an
address-space limit (RLIMIT_AS), so that a regression fails the test rather than the machine; the
child reports its wall time and how far its peak RSS grew during the call. Before these limits
(measured with the same files, the child limited to 3 GiB):

* the 100,000-character token: MemoryError after 2-3.5 s, RSS up 2.5 GB (8 GB without a limit), in
  the merge derivation, which sliced the token at every position; now about 0.01 s and 4 MB;
* ``block_count = 10**9`` in a 320-byte file: MemoryError after 24 s, RSS up 2.3 GB (2 minutes and
  7.7 GB without a limit), building per-layer lists before any check; now refused at once;
* tensor dimensions whose product passes 2**63: a byte count of 0 (2**32 x 2**32) or -2**64
  (2**62 x 3) from numpy's int64 wrap-around, taken as the tensor's size;
* a claimed 10**12-element array or string: "is truncated", not saying which key;
* wrongly typed metadata: TypeError or ZeroDivisionError from deep inside, or nothing at all (a
  token list given as one string, scores as strings, ``add_bos_token = "yes"``).
"""

from __future__ import annotations

import json
import random
import resource
import struct
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest
from gguf import GGUFValueType as V
from gguf import GGUFWriter, TokenType

from torchgemma.tokenizer.gguf import _derive_merges, tokenizer_from_metadata
from torchgemma.weights.gguf import GGUFError, read_gguf, read_gguf_metadata

MB = 1 << 20
LIMIT = 3 << 30  # the child's address space: torch and numpy take about 0.7 GiB of it on import


def bounded(code: str) -> dict:
    """Run `code` (which sets `call`, a function of no arguments) in a child limited to LIMIT bytes.

    Returns the call's error ("Type: message" or None), its wall seconds, and the growth of the
    child's peak RSS during the call, in bytes.
    """
    child = textwrap.dedent(
        """
        import json, resource, time
        {code}
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        start = time.perf_counter()
        try:
            call()
            error = None
        except BaseException as err:
            error = f"{{type(err).__name__}}: {{err}}"
        seconds = time.perf_counter() - start
        grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
        print(json.dumps({{"error": error, "seconds": seconds, "rss_growth": grown}}))
        """
    ).format(code=textwrap.dedent(code))

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))

    done = subprocess.run(
        [sys.executable, "-"], input=child, capture_output=True, text=True, timeout=120, preexec_fn=limit
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------------------------------
# Raw GGUF bytes (the layout of gguf-py's GGUFWriter), so that a header can claim what it likes


def gguf_string(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def kv(key: str, vtype: V, payload: bytes) -> bytes:
    return gguf_string(key) + struct.pack("<I", vtype) + payload


def u32(key: str, value: int) -> bytes:
    return kv(key, V.UINT32, struct.pack("<I", value))


def string(key: str, value: str) -> bytes:
    return kv(key, V.STRING, gguf_string(value))


def tensor_info(name: str, dims: tuple[int, ...], type_id: int = 0, offset: int = 0) -> bytes:
    return (
        gguf_string(name)
        + struct.pack("<I", len(dims))
        + b"".join(struct.pack("<Q", d) for d in dims)
        + struct.pack("<IQ", type_id, offset)
    )


def gguf_bytes(kvs: list[bytes], tensors: list[bytes] = (), data: bytes = b"", counts=None) -> bytes:
    n_tensors, n_kv = counts or (len(tensors), len(kvs))
    header = b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + b"".join(kvs) + b"".join(tensors)
    return header + bytes(-len(header) % 32) + data


def gemma3_keys(block_count: int) -> list[bytes]:
    return [
        string("general.architecture", "gemma3"),
        u32("gemma3.block_count", block_count),
        u32("gemma3.embedding_length", 64),
        u32("gemma3.attention.head_count", 4),
        u32("gemma3.feed_forward_length", 256),
        u32("gemma3.vocab_size", 32),
        u32("gemma3.attention.sliding_window", 512),
    ]


# --------------------------------------------------------------------------------------------------
# Finding 1: a 100,000-character vocabulary token


def write_vocab(path: Path, tokens: list[str]) -> Path:
    """A Gemma 3 style GGUF holding only a vocabulary: specials, byte tokens, then `tokens`."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    vocab = specials + byte_tokens + tokens
    types = [TokenType.CONTROL] * 4 + [TokenType.BYTE] * 256 + [TokenType.NORMAL] * len(tokens)
    writer = GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab)
    writer.add_token_scores([-float(i) for i in range(len(vocab))])
    writer.add_token_types([int(t) for t in types])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_100000_character_token_builds_in_linear_memory(tmp_path):
    rng = random.Random(0)
    long_token = "".join(rng.choice("ab▁") for _ in range(100_000))
    # The last two make one long merge: "a" + "a" * 99_999.
    tokens = ["a", "b", "▁", "ab", "ba", "▁a", "b▁", long_token, "a" * 99_999, "a" * 100_000]
    path = write_vocab(tmp_path / "long.gguf", tokens)
    assert path.stat().st_size < 500_000
    # Merges: every cut into two tokens, earlier tokens first, then the longer left part; the random
    # long token has none.
    merges = [["a", "b"], ["b", "a"], ["▁", "a"], ["b", "▁"], ["a" * 99_999, "a"], ["a", "a" * 99_999]]
    measured = bounded(
        f"""
        import json
        from torchgemma.tokenizer.gguf import tokenizer_from_gguf
        def call():
            tokenizer, _ = tokenizer_from_gguf({str(path)!r})
            assert tokenizer.get_vocab()[{long_token!r}] == 260 + 7
            assert json.loads(tokenizer.to_str())["model"]["merges"] == {merges!r}
            assert tokenizer.encode("ab ba", add_special_tokens=False).tokens == ["ab", "▁", "ba"]
        """
    )
    assert measured["error"] is None, measured
    # The tokenizer holds the long tokens a few times over (vocabulary, merges, JSON): a few MB.
    assert measured["rss_growth"] < 200 * MB, measured
    assert measured["seconds"] < 20, measured


def reference_merges(tokens: list[str], rank: dict[str, float]) -> list[tuple[str, str]]:
    """The merges as transformers' `generate_merges` orders them, trying every cut (quadratic)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for piece, score in rank.items():
        cuts = [(piece[:k], piece[k:]) for k in range(1, len(piece))]
        cuts = sorted(
            ((a, b) for a, b in cuts if a in vocab and b in vocab),
            key=lambda ab: (vocab[ab[0]], vocab[ab[1]]),
        )
        found.extend((score, len(a), len(b), a, b) for a, b in cuts)
    found.sort(key=lambda m: (m[0], m[1], m[2]), reverse=True)
    return [(a, b) for _, _, _, a, b in found]


@pytest.mark.parametrize("seed", range(40))
def test_merges_are_those_of_every_cut(seed):
    """Trying only cuts whose parts have token lengths finds the same merges, in the same order."""
    rng = random.Random(seed)
    alphabet = "ab▁c"[: rng.randint(1, 4)]
    lengths = [1, 1, 2, 3, 5, 8, 13, 40]
    tokens = [
        "".join(rng.choice(alphabet) for _ in range(rng.choice(lengths))) for _ in range(rng.randint(1, 80))
    ]
    tokens += list(alphabet) + [alphabet[-1] + alphabet[0]]  # so that some cuts are merges
    tokens += [""] * (seed % 7 == 0) + tokens[:1] * (seed % 5 == 0)  # an empty token; a duplicate
    scores = [-1.0, -2.0, 0.0]
    rank = {t: rng.choice(scores) if seed % 2 else -float(i) for i, t in enumerate(tokens)}
    merges = _derive_merges(tokens, rank)
    assert merges == reference_merges(tokens, rank)
    assert merges


# --------------------------------------------------------------------------------------------------
# Finding 3: layer counts and sizes


def test_a_billion_layers_are_refused_before_anything_is_built(tmp_path):
    path = tmp_path / "layers.gguf"
    path.write_bytes(gguf_bytes(gemma3_keys(10**9)))  # every key the config needs, no tensors
    assert path.stat().st_size == 320
    measured = bounded(
        f"""
        from torchgemma.weights.gguf import read_gguf
        def call():
            read_gguf({str(path)!r})
        """
    )
    assert measured["error"].startswith(
        "GGUFError: layers.gguf: metadata key gemma3.block_count is 1000000000;"
    )
    assert "at most 512 layers" in measured["error"]
    assert measured["seconds"] < 5 and measured["rss_growth"] < 50 * MB, measured


def test_block_count_must_match_the_tensor_table(tmp_path):
    norms = [tensor_info(f"blk.{i}.attn_norm.weight", (64,), offset=256 * i) for i in range(3)]
    path = tmp_path / "three.gguf"
    path.write_bytes(gguf_bytes(gemma3_keys(300), norms, bytes(1024)))
    with pytest.raises(
        GGUFError,
        match=r"three\.gguf: metadata key gemma3\.block_count is 300, but its tensor table has blk\.N "
        r"tensors for 3 layers \(0-2\)",
    ):
        read_gguf(path)
    gap = norms[:1] + [tensor_info("blk.2.attn_norm.weight", (64,), offset=512)]
    path.write_bytes(gguf_bytes(gemma3_keys(2), gap, bytes(1024)))
    with pytest.raises(
        GGUFError, match=r"block_count is 2, but its tensor table has blk\.N tensors for 2 layers \(0, 2\)"
    ):
        read_gguf(path)
    path.write_bytes(gguf_bytes(gemma3_keys(2), [], bytes(64)))
    with pytest.raises(GGUFError, match=r"block_count is 2, but its tensor table has no blk\.N tensors"):
        read_gguf(path)


def test_tensor_sizes_are_python_integers(tmp_path):
    # 2**32 x 2**32 wraps to 0 in int64, 3 x 2**62 to a negative count: both were taken as sizes.
    for dims in ((2**32, 2**32), (2**62, 3), (2**63,)):
        path = tmp_path / "huge.gguf"
        path.write_bytes(gguf_bytes(gemma3_keys(1), [tensor_info("token_embd.weight", dims)], bytes(64)))
        with pytest.raises(
            GGUFError, match=r"huge\.gguf: tensor token_embd\.weight has dimensions .* more than"
        ):
            read_gguf_metadata(path)
    # Within int64 but past the file's end: the byte count, a Python int, is compared with the size
    # (the layer's other tensors, which every layer has, are there so that this is what is refused).
    layer = [tensor_info("blk.0.attn_norm.weight", (2**40, 2**20))] + [
        tensor_info(f"blk.0.{name}.weight", (8,)) for name in ("attn_q", "attn_output")
    ]
    path.write_bytes(gguf_bytes(gemma3_keys(1), layer, bytes(64)))
    with pytest.raises(
        GGUFError, match=r"truncated: tensor blk\.0\.attn_norm\.weight needs bytes up to \d{19}"
    ):
        read_gguf(path)
    path.write_bytes(gguf_bytes(gemma3_keys(1), [tensor_info("token_embd.weight", (1,) * 5)], bytes(64)))
    with pytest.raises(GGUFError, match="token_embd.weight has 5 dimensions; GGUF allows at most 4"):
        read_gguf_metadata(path)


# --------------------------------------------------------------------------------------------------
# Finding 3: lengths the file cannot hold, refused before anything is read


def claimed_array(key: str, item: V, count: int) -> bytes:
    return kv(key, V.ARRAY, struct.pack("<IQ", item, count))


HUGE_CLAIMS = {
    "strings": (
        [claimed_array("tokenizer.ggml.tokens", V.STRING, 10**12)],
        r"tokenizer\.ggml\.tokens: an array of 1000000000000 STRING values",
    ),
    "floats": (
        [claimed_array("tokenizer.ggml.scores", V.FLOAT32, 10**12)],
        r"tokenizer\.ggml\.scores: an array of 1000000000000 FLOAT32 values",
    ),
    "arrays": (
        [claimed_array("gemma3.nested", V.ARRAY, 10**12)],
        r"gemma3\.nested: an array of 1000000000000 ARRAY values",
    ),
    "string": (
        [kv("general.name", V.STRING, struct.pack("<Q", 10**12))],
        r"metadata key general\.name: a string of 1000000000000 bytes",
    ),
    "key name": ([struct.pack("<Q", 10**12)], r"a metadata key name: a string of 1000000000000 bytes"),
    "one string of many": (
        [claimed_array("tokenizer.ggml.tokens", V.STRING, 3) + gguf_string("a") + struct.pack("<Q", 10**12)],
        r"metadata key tokenizer\.ggml\.tokens, string 1 of 3: a string of 1000000000000 bytes",
    ),
}


@pytest.mark.parametrize("claim", list(HUGE_CLAIMS))
def test_claimed_lengths_beyond_the_file_fail_at_once_by_name(tmp_path, claim):
    kvs, message = HUGE_CLAIMS[claim]
    path = tmp_path / "claims.gguf"
    path.write_bytes(gguf_bytes([string("general.architecture", "gemma3"), *kvs]) + bytes(200))
    tracemalloc.start()
    start = time.perf_counter()
    with pytest.raises(
        GGUFError,
        match=r"claims\.gguf is truncated: its header needs bytes up to \d+, file has \d+ \(.*" + message,
    ):
        read_gguf_metadata(path)
    seconds = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seconds < 1 and peak < 1 * MB, (seconds, peak)


def test_a_token_that_is_not_utf8_is_named(tmp_path):
    tokens = claimed_array("tokenizer.ggml.tokens", V.STRING, 2) + gguf_string("a") + gguf_string(b"\xff\xfe")
    path = tmp_path / "bytes.gguf"
    path.write_bytes(gguf_bytes([string("general.architecture", "gemma3"), tokens]))
    with pytest.raises(
        GGUFError, match=r"bytes\.gguf: metadata key tokenizer\.ggml\.tokens, string 1, is not UTF-8"
    ):
        read_gguf_metadata(path)


def test_a_vocabulary_is_decoded_when_read_and_a_bad_token_named_then(tmp_path):
    """A long string array (a 262k vocabulary) is walked when the header is read and decoded only
    when something reads it (loading the weights never does): a bad token is named at that read."""
    count = 5000
    items = b"".join(gguf_string(f"t{i}") for i in range(count - 1)) + gguf_string(b"\xff\xfe")
    tokens = claimed_array("tokenizer.ggml.tokens", V.STRING, count) + items
    path = tmp_path / "long.gguf"
    path.write_bytes(gguf_bytes([string("general.architecture", "gemma3"), tokens]))
    metadata = read_gguf_metadata(path)
    vocabulary = metadata["tokenizer.ggml.tokens"]
    assert len(vocabulary) == count
    with pytest.raises(
        GGUFError,
        match=rf"long\.gguf: metadata key tokenizer\.ggml\.tokens, string {count - 1}, is not UTF-8",
    ):
        vocabulary[0]


def test_claimed_key_and_tensor_counts_beyond_the_file_fail_at_once(tmp_path):
    path = tmp_path / "counts.gguf"
    path.write_bytes(gguf_bytes([string("general.architecture", "gemma3")], counts=(10**12, 10**12)))
    start = time.perf_counter()
    with pytest.raises(
        GGUFError,
        match=r"counts\.gguf is truncated: .* \(1000000000000 metadata keys and 1000000000000 tensors\)",
    ):
        read_gguf_metadata(path)
    assert time.perf_counter() - start < 1


# --------------------------------------------------------------------------------------------------
# Finding 3: metadata of the wrong type


def metadata_file(path: Path, keys: dict) -> Path:
    """A gemma3 GGUF with a block count of 2 and `keys`, each written as its Python type says."""
    writer = GGUFWriter(str(path), "gemma3")
    for key, value in {"gemma3.block_count": 2, **keys}.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


WRONG_TYPES = {
    "block count as a string": (
        {"gemma3.block_count": "18"},
        r"gemma3\.block_count should be an integer, but is the string '18'",
    ),
    "tokens as numbers": (
        {"tokenizer.ggml.tokens": [1, 2, 3]},
        r"tokenizer\.ggml\.tokens should be an array of strings, but is an array of 3 items "
        r"\(integer\)",
    ),
    "tokens as one string": (
        {"tokenizer.ggml.tokens": "abc"},
        r"tokenizer\.ggml\.tokens should be an array of strings, but is the string 'abc'",
    ),
    "scores as strings": (
        {"tokenizer.ggml.scores": ["0.5", "1"]},
        r"tokenizer\.ggml\.scores should be an array of numbers, but is an array of 2 items \(string\)",
    ),
    "token types as floats": (
        {"tokenizer.ggml.token_type": [1.0, 3.0]},
        r"tokenizer\.ggml\.token_type should be an array of integers, but is an array of 2 items \(float\)",
    ),
    "bos id as a string": (
        {"tokenizer.ggml.bos_token_id": "2"},
        r"tokenizer\.ggml\.bos_token_id should be an integer, but is the string '2'",
    ),
    "head count as a float": (
        {"gemma3.attention.head_count": 4.0},
        r"gemma3\.attention\.head_count should be an integer or an array of integers \(one per layer\), "
        r"but is the float 4\.0",
    ),
    "a bool as a count": (
        {"gemma3.vocab_size": True},
        r"gemma3\.vocab_size should be an integer, but is the bool True",
    ),
    "no heads": (
        {"gemma3.attention.head_count": 0},
        r"gemma3\.attention\.head_count is 0; it must be at least 1",
    ),
    "a per-layer array of the wrong length": (
        {"gemma3.feed_forward_length": [256, 256, 256]},
        r"gemma3\.feed_forward_length has 3 entries, but gemma3\.block_count is 2 \(one entry per layer\)",
    ),
}


@pytest.mark.parametrize("case", list(WRONG_TYPES))
def test_wrongly_typed_metadata_is_refused_by_name(tmp_path, case):
    keys, message = WRONG_TYPES[case]
    path = metadata_file(tmp_path / "typed.gguf", keys)
    with pytest.raises(GGUFError, match=r"typed\.gguf: metadata key " + message):
        read_gguf_metadata(path)
    with pytest.raises(GGUFError, match=message):
        read_gguf(path)


def test_architecture_must_be_a_string(tmp_path):
    path = tmp_path / "arch.gguf"
    path.write_bytes(gguf_bytes([u32("general.architecture", 7)]))
    with pytest.raises(GGUFError, match=r"general\.architecture should be a string, but is the integer 7"):
        read_gguf_metadata(path)


def test_the_tokenizer_checks_metadata_it_is_given():
    good = {
        "general.architecture": "gemma3",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": ["<pad>", "<eos>", "<bos>", "a"],
    }
    tokenizer_from_metadata(good)  # builds
    with pytest.raises(
        GGUFError, match=r"x\.gguf: metadata key tokenizer\.ggml\.scores should be an array of numbers"
    ):
        tokenizer_from_metadata({**good, "tokenizer.ggml.scores": [None] * 4}, source="x.gguf")
    with pytest.raises(
        GGUFError, match=r"tokenizer\.ggml\.add_bos_token should be a bool, but is the string 'yes'"
    ):
        tokenizer_from_metadata({**good, "tokenizer.ggml.add_bos_token": "yes"})
    gemma4 = {**good, "general.architecture": "gemma4", "tokenizer.ggml.model": "gemma4"}
    with pytest.raises(GGUFError, match=r"tokenizer\.ggml\.merges entry 1 is 'a b c', not two tokens"):
        tokenizer_from_metadata({**gemma4, "tokenizer.ggml.merges": ["a b", "a b c"]})


def test_valid_files_still_read(tmp_path):
    # The checks pass the layouts the converter writes: per-layer arrays, bool patterns, float keys.
    path = tmp_path / "fine.gguf"
    writer = GGUFWriter(str(path), "gemma4")
    writer.add_block_count(2)
    writer.add_feed_forward_length([96, 192])
    writer.add_sliding_window_pattern([True, False])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_uint32("tokenizer.ggml.bos_token_id", 2)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    metadata = read_gguf_metadata(path)
    assert metadata["gemma4.feed_forward_length"] == [96, 192]
    assert metadata["gemma4.attention.sliding_window_pattern"] == [True, False]
