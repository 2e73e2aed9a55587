"""What the benchmarks share: an E2B-width random checkpoint, and a description of the machine."""

from __future__ import annotations

import gc
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

SLIDING, FULL = "sliding_attention", "full_attention"


def e2b_like_config(layers: int, shared: int | None = None) -> dict:
    """Gemma 4 E2B's real widths with fewer layers: the 4:1 pattern, and the last 40% of the layers
    KV-shared (E2B: 20 of 35), so that with 10 layers both a sliding and a full layer share
    (``shared`` overrides the count)."""
    pattern = ([SLIDING] * 4 + [FULL]) * ((layers + 4) // 5)
    return dict(
        vocab_size=262144,
        vocab_size_per_layer_input=262144,
        hidden_size=1536,
        intermediate_size=6144,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=1,
        head_dim=256,
        global_head_dim=512,
        hidden_size_per_layer_input=256,
        layer_types=pattern[:layers],
        sliding_window=512,
        num_kv_shared_layers=(layers * 4) // 10 if shared is None else shared,
        use_double_wide_mlp=True,
        final_logit_softcapping=30.0,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=[1, 106],
    )


def build_checkpoint(folder: Path, layers: int, shared: int | None = None) -> Path:
    """A random checkpoint (bf16 on disk) with transformers' own initialisation."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    if (folder / "config.json").is_file():
        return folder
    print(f"building a random {layers}-layer E2B-width checkpoint in {folder} ...", file=sys.stderr)
    torch.manual_seed(0)
    config = Gemma4TextConfig(**e2b_like_config(layers, shared), dtype="bfloat16")
    model = Gemma4ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    gc.collect()
    return folder


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
        if dirty.stdout.strip():
            commit += "+dirty"
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    import transformers

    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": commit,
    }
