"""A 32,768-token prompt at Gemma 4 E2B's widths: chunked prefill in bounded memory (slow).

5 random layers (4 sliding, 1 full; hidden 1536, 8 heads, 1 KV head, head dims 256/512, MLP 6144,
PLE 256, vocabulary 262144), float32, prefill chunks of 512 tokens. Measured on the 2-core EPYC
(benchmarks/README.md): 0.16 GiB of peak memory beyond the weights (4 GB) and the cache, about 4
minutes. The bound below leaves room for allocator noise; a prefill that materialised one full
layer's scores (8 heads x 32K x 32K floats) would need 32 GiB.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


@pytest.mark.slow
def test_32k_prompt_prefills_in_bounded_memory(tmp_path_factory):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import build_checkpoint

    folder = build_checkpoint(tmp_path_factory.mktemp("long") / "e2b-5l", layers=5, shared=0)
    command = [
        sys.executable, str(ROOT / "benchmarks" / "bench_long_prompt.py"), "--child",
        "--checkpoint", str(folder), "--length", "32768", "--implementation", "sdpa",
        "--dtype", "fp32", "--chunk", "512", "--threads", "2",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["length"] == 32768
    # The slot holds the prompt and one new token. Full layer: 32769 columns x 512 dims, K and V,
    # 4 bytes; 4 sliding layers: 511 columns x 256 dims.
    assert result["cache_bytes"] == 2 * 4 * (32769 * 512 + 4 * 511 * 256)
    assert result["peak_beyond_weights_and_cache_bytes"] < 1 * GIB, result
