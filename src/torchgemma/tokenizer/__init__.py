"""Text in, ids out, and back: the tokenizer, its GGUF vocabulary, the chat template.

    tokenizer.py       tokenizer.json (and friends) as transformers builds them; streaming decode
    gguf.py            the same tokenizer rebuilt from a GGUF file's vocabulary
    chat_template.py   the checkpoint's Jinja chat template, rendered as transformers renders it

Checkpoints are found through ``weights.source``; nothing here loads a model.
"""

from .tokenizer import (
    GEMMA4_TOKENS,
    TOKENIZER_FILES,
    StreamDecoder,
    Tokenizer,
    UnknownTokenError,
    load_tokenizer,
)

__all__ = [
    "GEMMA4_TOKENS",
    "TOKENIZER_FILES",
    "StreamDecoder",
    "Tokenizer",
    "UnknownTokenError",
    "load_tokenizer",
]
