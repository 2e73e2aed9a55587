"""Text in, ids out, and back: the tokenizer, its GGUF vocabulary, the chat template.

    tokenizer.py       the Tokenizer: encode, decode, special tokens, chat template; streaming decode
    loading.py         tokenizer.json (and friends) -> a Tokenizer, as transformers builds it
    gguf.py            the same tokenizer rebuilt from a GGUF file's vocabulary
    chat_template.py   the checkpoint's Jinja chat template, rendered as transformers renders it

Checkpoints are found through ``weights.source``; nothing here loads a model.
"""

from .loading import TOKENIZER_FILES, load_tokenizer
from .tokenizer import GEMMA4_TOKENS, StreamDecoder, Tokenizer, UnknownTokenError

__all__ = [
    "GEMMA4_TOKENS",
    "TOKENIZER_FILES",
    "StreamDecoder",
    "Tokenizer",
    "UnknownTokenError",
    "load_tokenizer",
]
