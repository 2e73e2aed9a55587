"""Where the vision and audio towers run under tensor parallelism, in figures.

Every rank holds the towers whole and embeds the same media (``generation/ranks.py``: the media
travel to the followers as the processor made them). The alternative is rank 0 alone embedding and
broadcasting the embedded prompt. This script gives what decides between them:

1. memory: the towers' parameters next to a rank's share of the text decoder (bf16, the published
   E2B with its vision and audio towers and the 31B with its large vision tower; from the configs,
   as ``torchgemma info``);
2. time, on 2 gloo ranks of one CPU thread each: the E2B-width vision tower on one image (each rank
   runs it at the same time), against broadcasting what rank 0 would send instead: the image's
   embeddings (what replicated towers save sending) and the pixel values (what is sent now).

    python benchmarks/bench_tp_towers.py [--soft-tokens 70]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

ON_DEVICE_VISION = dict(
    model_type="gemma4_vision",
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=16,
    num_attention_heads=12,
    num_key_value_heads=12,
    head_dim=64,
    use_clipped_linears=True,
    standardize=False,
)
LARGE_VISION = dict(
    model_type="gemma4_vision",
    hidden_size=1152,
    intermediate_size=4304,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=72,
    use_clipped_linears=False,
    standardize=True,
)
AUDIO = dict(
    model_type="gemma4_audio",
    hidden_size=1024,
    num_hidden_layers=12,
    num_attention_heads=8,
    subsampling_conv_channels=[128, 32],
    output_proj_dims=1536,
    use_clipped_linears=True,
)


def config_folder(root: Path, text: dict, vision: dict, audio: dict | None) -> Path:
    from published_configs import multimodal

    folder = root / text.get("name", "m")
    folder.mkdir(parents=True, exist_ok=True)
    body = multimodal({k: v for k, v in text.items() if k != "name"})
    body.update(vision_config=vision, audio_config=audio)
    (folder / "config.json").write_text(json.dumps(body))
    return folder


def memory_table(root: Path) -> None:
    import torchgemma
    from published_configs import D31B, E2B
    from torchgemma.info import describe, rank_memory

    for name, text, vision, audio in (
        ("E2B", E2B, ON_DEVICE_VISION, AUDIO),
        ("31B", D31B, LARGE_VISION, None),
    ):
        config = torchgemma.ModelConfig.from_file(config_folder(root, {**text, "name": name}, vision, audio))
        towers = describe(config, context=4096, dtype=torch.bfloat16)["params_by_tower"]
        tower = towers.get("vision", 0) + towers.get("audio", 0)
        line = f"{name}: towers {tower / 1e6:.0f}M parameters ({tower * 2 / 2**20:.0f} MiB bf16; "
        line += ", ".join(f"{k} {v / 1e6:.0f}M" for k, v in towers.items() if k != "language_model") + ")"
        for size in (2, 4):
            rank = rank_memory(config, size, context=4096)["params_per_rank"]
            line += f"; N={size}: a rank holds {rank / 1e6:.0f}M, the towers {100 * tower / rank:.1f}% of it"
        print(line)


def rank_main(rank: int, size: int, port: int, soft_tokens: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    import numpy as np

    import torchgemma

    # E2B's text widths (the projector's output), one layer and a small vocabulary: the tower alone matters.
    from published_configs import E2B
    from torchgemma.processing.image import process_images

    text = dict(
        E2B, name="towers", num_hidden_layers=1, layer_types=["full_attention"], num_kv_shared_layers=0
    )
    text.update(vocab_size=512, vocab_size_per_layer_input=512)
    root = Path(out).parent / f"cfg{rank}"
    config = torchgemma.ModelConfig.from_file(config_folder(root, text, ON_DEVICE_VISION, None))
    torch.manual_seed(0)
    model = torchgemma.Gemma(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (600, 800, 3), dtype=np.uint8)
    media = process_images(image, max_soft_tokens=soft_tokens)
    pixels, positions = media["pixel_values"], media["image_position_ids"]
    tower, send_embeds, send_pixels = [], [], []
    for _ in range(3):
        dist.barrier()
        start = time.thread_time()
        with torch.inference_mode():
            soft = model.image_features(pixels, positions)
        tower.append(time.thread_time() - start)
        for sent, times in (([soft.to(torch.bfloat16)], send_embeds), ([media], send_pixels)):
            dist.barrier()
            start = time.perf_counter()
            dist.broadcast_object_list(sent if rank == 0 else [None], src=0)
            times.append(time.perf_counter() - start)
    if rank == 0:
        result = dict(
            soft_tokens=int(soft.shape[0]),
            embeds_mib=soft.numel() * 2 / 2**20,
            pixels_mib=pixels.numel() * 4 / 2**20,
            tower_s=statistics.median(tower),
            send_embeds_s=statistics.median(send_embeds),
            send_pixels_s=statistics.median(send_pixels),
            load=os.getloadavg()[0],
        )
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--soft-tokens", type=int, default=70)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        memory_table(Path(tmp))
        from distributed_fixtures import free_port

        out = str(Path(tmp) / "times.json")
        mp.spawn(rank_main, args=(2, free_port(), args.soft_tokens, out), nprocs=2)
        r = json.loads(Path(out).read_text())
    print(
        f"one image of {r['soft_tokens']} soft tokens, E2B-width vision tower, 1 thread per rank "
        f"(load {r['load']:.1f}): the tower {r['tower_s'] * 1e3:.0f} ms CPU on each rank; broadcasting "
        f"its bf16 embeddings ({r['embeds_mib']:.2f} MiB) {r['send_embeds_s'] * 1e3:.1f} ms, its pixel "
        f"values ({r['pixels_mib']:.2f} MiB, what is sent now) {r['send_pixels_s'] * 1e3:.1f} ms (gloo)"
    )


if __name__ == "__main__":
    main()
