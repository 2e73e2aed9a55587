"""One rank of the tensor-parallel media and constraint checks (tests/test_distributed_media.py
starts N of them with torchrun's environment; with WORLD_SIZE=1, or imported, one process): an
E2B-like checkpoint with image and audio towers, split over the ranks, runs

* ``llm``: ``LLM`` calls made alike on every rank (as ``torchgemma generate`` under torchrun): the
  logits of a prompt with an image and a clip, a greedy chat with them, a seeded sampled one, a
  chat held to a JSON schema, and a greedy chat about a video;
* ``engine``: one ``Engine`` batch led by rank 0 (as the server under torchrun): media (an image
  and a clip; a video), a JSON
  schema and a regex (constraints rank 0 alone holds), seeded sampling, log-probabilities, and a
  constraint that allows nothing (its request fails on every rank, the others go on).

Rank 0 writes what it got to a safetensors file.

    python tests/tp_media_worker.py OUT.safetensors FOLDER
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from PIL import Image
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parent))

from torchgemma import Engine, SamplingParams  # noqa: E402
from torchgemma.generation import MEDIA_INPUTS, Grammar  # noqa: E402
from torchgemma.generation.ranks import LeaderEngine, follow  # noqa: E402
from torchgemma.llm import LLM  # noqa: E402
from torchgemma.model.inputs import MediaInputs  # noqa: E402

NEW = 10
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"],
}
JSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}


def media_messages() -> list[dict]:
    rng = np.random.default_rng(7)
    image = Image.fromarray(rng.integers(0, 256, (90, 120, 3), dtype=np.uint8))
    clip = 0.1 * rng.standard_normal(6400).astype(np.float32)
    content = [{"type": "image", "image": image}, {"type": "audio", "audio": clip}]
    return [{"role": "user", "content": [*content, {"type": "text", "text": "What is this?"}]}]


def video_messages() -> list[dict]:
    """A clip of 4 frames (the LLM keeps 2)."""
    rng = np.random.default_rng(8)
    frames = [Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)) for _ in range(4)]
    return [
        {"role": "user", "content": [{"type": "video", "video": frames}, {"type": "text", "text": "And?"}]}
    ]


def text_messages(text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}]}]


def llm_calls(llm: LLM) -> dict[str, torch.Tensor]:
    inputs = llm.chat_inputs(media_messages())
    media = {name: inputs[name] for name in MEDIA_INPUTS if name in inputs}
    with torch.no_grad():
        logits = llm.model(inputs["input_ids"], **media).float()
    greedy = llm.chat(media_messages(), temperature=0, max_new_tokens=NEW, stop_token_ids=[])
    sampled = llm.chat(media_messages(), temperature=1.0, seed=11, max_new_tokens=NEW, stop_token_ids=[])
    shaped = llm.chat(
        text_messages("Describe a thing."), temperature=1.0, seed=5, response_format=JSON_FORMAT
    )
    video = llm.chat(video_messages(), temperature=0, max_new_tokens=NEW, stop_token_ids=[])
    return {
        "llm.logits": logits[0, -6:],  # the image's and clip's soft tokens are all before these
        "llm.greedy": torch.tensor(greedy.token_ids),
        "llm.sampled": torch.tensor(sampled.token_ids),
        "llm.json": torch.tensor(shaped.token_ids),
        "llm.video": torch.tensor(video.token_ids),
    }


class NothingAllowed:
    """A constraint that allows no token: its request fails (on every rank)."""

    def allowed_mask(self, vocab_size: int) -> torch.Tensor:
        return torch.zeros(vocab_size, dtype=torch.bool)

    def advance(self, token_id: int) -> None:
        raise AssertionError("nothing was allowed")


def engine_calls(llm: LLM) -> dict[str, torch.Tensor]:
    """Six requests batched in one engine; each one's tokens, chosen tokens' log-probabilities
    and finish reason (0 stop, 1 length, 2 error)."""
    engine = Engine(llm.model, max_batch_size=5, max_len=512, prefill_chunk=64)
    if dist.is_initialized():
        if dist.get_rank() != 0:
            follow(engine)
            return {}
        engine = LeaderEngine(engine)
    inputs = llm.chat_inputs(media_messages())
    media = MediaInputs.from_dict({name: inputs[name] for name in MEDIA_INPUTS if name in inputs})
    clip = llm.chat_inputs(video_messages())
    video = MediaInputs.from_dict({name: clip[name] for name in MEDIA_INPUTS if name in clip})
    tokenizer = llm.tokenizer
    prompt = llm.chat_inputs(text_messages("Give me a thing."))["input_ids"][0].tolist()
    end = [tokenizer.turn_end_id]
    requests = {
        "media": dict(input_ids=inputs["input_ids"][0], media=media, logprobs=3, stop_token_ids=[]),
        "json": dict(
            input_ids=prompt,
            constraint=Grammar.json_schema(tokenizer, SCHEMA),
            sampling=SamplingParams(temperature=1.0, seed=3),
            logprobs=2,
            stop_token_ids=end,
            max_new_tokens=40,
        ),
        "regex": dict(
            input_ids=prompt,
            constraint=Grammar.regex(tokenizer, "[a-z]{2,5} [0-9]{1,3}!"),
            stop_token_ids=end,
        ),
        "video": dict(input_ids=clip["input_ids"][0], media=video, stop_token_ids=[]),
        "seeded": dict(
            input_ids=prompt, sampling=SamplingParams(temperature=0.8, top_k=20, seed=9), logprobs=0
        ),
        "refused": dict(input_ids=prompt, constraint=NothingAllowed()),
    }
    out = {name: ([], [], -1) for name in requests}
    for name, request in requests.items():
        engine.add_request(name, request.pop("input_ids"), **{"max_new_tokens": NEW, **request})
    while engine.has_unfinished_requests():
        for step in engine.step():
            tokens, logprobs, _ = out[step.request_id]
            if step.token_id is not None:  # (None: the request failed)
                tokens.append(step.token_id)
                logprobs.append(step.logprobs.logprob if step.logprobs is not None else 0.0)
            if step.finished:
                reason = ["stop", "length", "error"].index(step.finish_reason)
                out[step.request_id] = (tokens, logprobs, reason)
    if isinstance(engine, LeaderEngine):
        engine.close()
    results = {}
    for name, (tokens, logprobs, reason) in out.items():
        results[f"engine.{name}.tokens"] = torch.tensor(tokens, dtype=torch.long)
        results[f"engine.{name}.logprobs"] = torch.tensor(logprobs, dtype=torch.float64)
        results[f"engine.{name}.reason"] = torch.tensor([reason])
    return results


def run(folder: Path) -> dict[str, torch.Tensor]:
    """Both tasks; split over the ranks when a process group's environment is set (WORLD_SIZE > 1)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    options = {"tensor_parallel_size": size} if size > 1 else {}
    llm = LLM(folder, dtype=torch.float32, attention="eager", prefix_cache_gb=0, progress=False, **options)
    llm.video_num_frames, llm.video_soft_tokens = 2, 70
    return {**llm_calls(llm), **engine_calls(llm)}


def main() -> None:
    out, folder = sys.argv[1], Path(sys.argv[2])
    torch.set_num_threads(1)
    results = {key: value.contiguous() for key, value in run(folder).items()}
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_file(results, out)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
