"""``torchgemma embed``: sentence vectors from a sentence-transformers checkpoint, one JSON line per
text, image or audio file (images and audio: EmbeddingGemma 2)."""

from __future__ import annotations

import argparse
import json
import sys

from .common import CLIError, load_llm, prepare
from .options import add_model_flags, int_at_least
from .precheck import check_sentence_head


def add_parser(commands) -> None:
    embed = commands.add_parser(
        "embed",
        help="sentence vectors from a sentence-transformers checkpoint (EmbeddingGemma, EmbeddingGemma 2)",
        description="Sentence embeddings, as sentence-transformers computes them: the checkpoint's "
        "decoder, pooling, dense layers and normalisation, with a task prompt. Prints one JSON line per "
        'text: {"text": ..., "embedding": [...]}. Texts are the arguments, or standard input\'s lines '
        "when there are none.",
    )
    add_model_flags(embed)
    embed.add_argument("texts", nargs="*", help="the texts (default: one per line of standard input)")
    embed.add_argument("--image", action="append", default=[], metavar="PATH", help="an image file to embed")
    embed.add_argument("--audio", action="append", default=[], metavar="PATH", help="an audio file to embed")
    embed.add_argument(
        "--prompt-name",
        default=None,
        help="a task prompt of the checkpoint (EmbeddingGemma: query, document, ...)",
    )
    embed.add_argument("--prompt", default=None, help="a literal prompt written before each text")
    embed.add_argument(
        "--dimensions", type=int_at_least(1), default=None, help="keep the first N dimensions (Matryoshka)"
    )
    embed.add_argument("--batch-size", type=int_at_least(1), default=32)
    embed.set_defaults(func=run, parser=embed, quiet=True, verbose=False)


def run(args: argparse.Namespace) -> int:
    texts = args.texts
    if not texts and not args.image and not args.audio:
        texts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
        if not texts:
            raise CLIError("no texts: give them as arguments or on standard input, one per line")
    args.video = []
    prepare(args)  # the media files are read (headers) before the model loads
    check_sentence_head(args)
    llm = load_llm(args)
    if not llm.has_sentence_head:
        raise CLIError(f"{args.model} has no sentence-transformers modules (modules.json): it cannot embed")
    inputs = [*texts, *({"image": path} for path in args.image), *({"audio": path} for path in args.audio)]
    labels = (
        [{"text": t} for t in texts] + [{"image": p} for p in args.image] + [{"audio": p} for p in args.audio]
    )
    vectors = llm.embed(
        inputs,
        prompt_name=args.prompt_name,
        prompt=args.prompt,
        batch_size=args.batch_size,
        truncate_dim=args.dimensions,
    )
    for label, vector in zip(labels, vectors.float().cpu()):
        print(json.dumps({**label, "embedding": vector.tolist()}))
    return 0
