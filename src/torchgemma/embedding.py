"""Sentence embeddings: a sentence-transformers checkpoint folder (EmbeddingGemma) as text in, vectors out.

    llm = torchgemma.LLM("google/embeddinggemma-300m")       # or a local folder
    queries = llm.embed(["Which planet is known as the Red Planet?"], prompt_name="query")    # (1, 768)
    documents = llm.embed(["Mars, the fourth planet, looks red."], prompt_name="document")
    scores = queries @ documents.T                             # unit vectors: cosine similarities
    torchgemma.embed(texts, model="path/to/embeddinggemma-300m")   # one-off: loads, then embeds

The folder is what sentence-transformers saves. ``modules.json`` lists the pipeline: the decoder
(EmbeddingGemma: a bidirectional Gemma 3, whose ``config.json`` and weights sit in the folder itself),
then ``1_Pooling`` (the mean of the text's token states), ``2_Dense`` and ``3_Dense`` (linear layers,
each with its ``config.json`` and ``model.safetensors``) and ``4_Normalize`` (unit length).
``config_sentence_transformers.json`` holds the task prompts written before each text ("query",
"document", ...). Every step repeats sentence-transformers' own arithmetic and batching, so the
vectors equal ``SentenceTransformer(folder).encode(texts, ...)`` (tests/test_embedding.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .config import TextConfig
from .tokenizer import Tokenizer
from .weights.safetensors import read_safetensors

if TYPE_CHECKING:
    from .model import Gemma

MODULES_FILE = "modules.json"
PROMPTS_FILE = "config_sentence_transformers.json"

# modules.json "type" -> what the module does. sentence-transformers 5 wrote the short names
# (EmbeddingGemma's published files); version 6 writes the long ones.
MODULE_KINDS = {
    "sentence_transformers.models.Transformer": "transformer",
    "sentence_transformers.base.modules.transformer.Transformer": "transformer",
    "sentence_transformers.models.Pooling": "pooling",
    "sentence_transformers.sentence_transformer.modules.pooling.Pooling": "pooling",
    "sentence_transformers.models.Dense": "dense",
    "sentence_transformers.base.modules.dense.Dense": "dense",
    "sentence_transformers.models.Normalize": "normalize",
    "sentence_transformers.base.modules.normalize.Normalize": "normalize",
}

# Dense activations by the class path sentence-transformers saves; a table, never an import of a
# name read from a file.
ACTIVATIONS: dict[str, type[nn.Module]] = {
    "torch.nn.modules.linear.Identity": nn.Identity,
    "torch.nn.modules.activation.Tanh": nn.Tanh,
    "torch.nn.modules.activation.ReLU": nn.ReLU,
    "torch.nn.modules.activation.GELU": nn.GELU,
    "torch.nn.modules.activation.Sigmoid": nn.Sigmoid,
    "torch.nn.modules.activation.SiLU": nn.SiLU,
}
# sentence-transformers' Dense default when its config names no activation.
DEFAULT_ACTIVATION = "torch.nn.modules.activation.Tanh"

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# Pooling configs before sentence-transformers 6 had one flag per mode, in this order.
LEGACY_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
# The feature every module after the decoder reads and writes.
SENTENCE_FEATURE = "sentence_embedding"


def _read_json(path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from error


# ── pooling ──────────────────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class Pooling:
    """Token states (B, T, H) of right-padded rows -> one vector per row (B, H).

    The arithmetic is sentence-transformers' ``Pooling`` (sums of bf16/fp16 states in float32,
    the result back in the states' dtype), so the vectors match to the bit. ``include_prompt=False``
    leaves the prompt's tokens out of the pool (they still shape the others through attention).
    """

    mode: str = "mean"
    include_prompt: bool = True

    @classmethod
    def from_config(cls, path: Path, hidden_size: int) -> Pooling:
        data = _read_json(path)
        mode = data.get("pooling_mode")
        if mode is None:  # the flags of sentence-transformers 5 (mean when none is set)
            modes = [name for flag, name in LEGACY_POOLING_FLAGS.items() if data.get(flag)]
            mode = modes if len(modes) > 1 else (modes[0] if modes else "mean")
        if isinstance(mode, list) and len(mode) == 1:
            mode = mode[0]
        if not isinstance(mode, str):
            raise ValueError(f"{path}: pooling modes {mode} are concatenated; only one mode is supported")
        if mode not in POOLING_MODES:
            raise ValueError(f"{path}: unknown pooling_mode {mode!r}; known: {', '.join(POOLING_MODES)}")
        width = data.get("embedding_dimension", data.get("word_embedding_dimension", hidden_size))
        if width != hidden_size:
            raise ValueError(
                f"{path}: embedding_dimension {width} differs from the width of the model's states, {hidden_size}"
            )
        return cls(mode, bool(data.get("include_prompt", True)))

    def __call__(self, states: torch.Tensor, mask: torch.Tensor, prompt_length: int = 0) -> torch.Tensor:
        if prompt_length and not self.include_prompt:
            mask = mask.clone()
            mask[:, :prompt_length] = 0  # rows are right-padded: every row's prompt starts at 0
        dtype = states.dtype
        wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        if self.mode == "cls":  # the first pooled token
            first = mask.to(torch.int).argmax(dim=1)
            return states[torch.arange(len(states), device=states.device), first]
        if self.mode == "max":
            keep = mask.unsqueeze(-1).expand_as(states).to(dtype)
            return states.masked_fill(keep == 0, float("-inf")).max(dim=1).values
        if self.mode in ("mean", "mean_sqrt_len_tokens"):
            keep = mask.unsqueeze(-1).to(dtype)
            total = (states * keep).sum(dim=1, dtype=wide)
            count = torch.clamp(keep.sum(dim=1, dtype=wide), min=1e-9)
            return (total / (count if self.mode == "mean" else torch.sqrt(count))).to(dtype)
        if self.mode == "weightedmean":  # token i (from 1) weighs i
            weights = torch.arange(1, states.shape[1] + 1, device=states.device, dtype=wide).view(1, -1, 1)
            weighted = mask.unsqueeze(-1).to(wide) * weights
            total = (states * weighted).sum(dim=1)
            return (total / torch.clamp(weighted.sum(dim=1), min=1e-9)).to(dtype)
        # lasttoken: the last pooled token (a row without any: its last column, zeroed)
        length = states.shape[1]
        found, from_end = mask.flip(1).max(1)
        from_end = torch.where(found == 0, length - 1, from_end)
        keep = mask.unsqueeze(-1).expand_as(states).to(dtype)
        return (states * keep)[torch.arange(len(states), device=states.device), length - from_end - 1]


# ── dense layers ─────────────────────────────────────────────────────────────────────────────


class Dense(nn.Module):
    """``activation(linear(x))``; ``linear.weight`` / ``linear.bias`` are the module's tensor names."""

    def __init__(self, in_features: int, out_features: int, bias: bool, activation: str):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features, bias=bias)
        self.activation = ACTIVATIONS[activation]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.linear(x))

    @classmethod
    def from_folder(cls, folder: Path) -> Dense:
        """A ``N_Dense`` folder: ``config.json`` for the shape, ``model.safetensors`` for the weights."""
        data = _read_json(folder / "config.json")
        for key in ("module_input_name", "module_output_name"):
            if data.get(key, SENTENCE_FEATURE) != SENTENCE_FEATURE:
                raise ValueError(f"{folder}/config.json: {key}={data[key]!r} is not supported")
        if data.get("use_residual"):
            raise ValueError(f"{folder}/config.json: use_residual is not supported")
        activation = data.get("activation_function") or DEFAULT_ACTIVATION
        if activation not in ACTIVATIONS:
            raise ValueError(
                f"{folder}/config.json: activation {activation!r} is not one of {', '.join(ACTIVATIONS)}"
            )
        try:
            dense = cls(
                int(data["in_features"]), int(data["out_features"]), bool(data.get("bias", True)), activation
            )
        except KeyError as error:
            raise ValueError(f"{folder}/config.json has no {error.args[0]!r}") from error
        dense.load_weights(folder)
        return dense

    def load_weights(self, folder: Path) -> None:
        """Strictly: every tensor present, none extra, each of its shape. Pickles are refused."""
        path = folder / "model.safetensors"
        if not path.is_file():
            pickled = [p.name for p in (folder / "pytorch_model.bin", folder / "model.pt") if p.is_file()]
            if pickled:
                raise ValueError(
                    f"{folder}/{pickled[0]} is a pickle, which torchgemma never loads: save the module "
                    "as safetensors (SentenceTransformer.save(..., safe_serialization=True))"
                )
            raise FileNotFoundError(f"{path} is missing")
        expected = self.state_dict()
        with ExitStack() as stack:
            tensors = {name: (load, shape) for name, load, shape, _ in read_safetensors([path], stack)}
            names = set(tensors)
            for name, target in expected.items():
                if name not in names:
                    raise ValueError(f"{path} has no tensor {name!r} (config.json's shape needs it)")
                load, shape = tensors[name]
                if tuple(shape) != tuple(target.shape):
                    raise ValueError(
                        f"{path}: {name} has shape {list(shape)}, config.json says {list(target.shape)}"
                    )
                with torch.no_grad():
                    target.copy_(load())
        extra = sorted(names - set(expected))
        if extra:
            raise ValueError(f"{path} has unexpected tensors: {', '.join(extra)}")


# ── the head ─────────────────────────────────────────────────────────────────────────────────


class SentenceHead(nn.Module):
    """What turns the decoder's token states into a sentence vector, and how texts are prepared.

    Built from a sentence-transformers folder by ``from_folder``: the pooling, dense layers and
    normalisation in ``modules.json`` order; the task prompts and default prompt; the most tokens
    a text keeps (longer ones are cut at the end, their special tokens kept).
    """

    def __init__(
        self,
        pooling: Pooling,
        dense: Sequence[Dense] = (),
        normalize: bool = False,
        *,
        prompts: dict[str, str] | None = None,
        default_prompt_name: str | None = None,
        max_length: int,
        dimension: int,
    ):
        super().__init__()
        self.pooling = pooling
        self.dense = nn.ModuleList(dense)
        self.normalize = normalize
        self.prompts = dict(prompts or {})
        self.default_prompt_name = default_prompt_name
        self.max_length = max_length
        self.dimension = dimension  # length of the vectors

    @classmethod
    def from_folder(cls, folder: str | Path, text: TextConfig) -> SentenceHead:
        """Read ``folder``'s sentence-transformers modules for a decoder of config ``text``."""
        folder = Path(folder)
        if not (folder / MODULES_FILE).is_file():
            raise FileNotFoundError(
                f"{folder} has no {MODULES_FILE}: sentence embeddings need a sentence-transformers folder "
                "(such as EmbeddingGemma's), with its pooling, dense and normalize modules"
            )
        entries = _read_json(folder / MODULES_FILE)
        entries = sorted(entries, key=lambda entry: entry.get("idx", 0))
        kinds = [MODULE_KINDS.get(entry.get("type")) for entry in entries]
        for entry, kind in zip(entries, kinds):
            if kind is None:
                raise ValueError(
                    f"{folder}/{MODULES_FILE}: module type {entry.get('type')!r} is not supported"
                )
        if kinds[:1] != ["transformer"] or entries[0].get("path", "") != "":
            raise ValueError(
                f"{folder}/{MODULES_FILE}: the first module must be the Transformer, saved in the folder itself"
            )
        if kinds[1:2] != ["pooling"] or "transformer" in kinds[2:] or "pooling" in kinds[2:]:
            raise ValueError(f"{folder}/{MODULES_FILE}: a Pooling module must follow the Transformer, once")
        max_length = _max_length(folder, text)
        pooling = Pooling.from_config(folder / entries[1]["path"] / "config.json", text.states_width)
        dense, normalize = [], False
        width = text.states_width
        for entry, kind in zip(entries[2:], kinds[2:]):
            where = folder / entry["path"]
            if normalize:
                raise ValueError(
                    f"{folder}/{MODULES_FILE}: {entry['path']} follows Normalize, which must come last"
                )
            if kind == "normalize":
                config = _read_json(where / "config.json") if (where / "config.json").is_file() else {}
                if config.get("module_input_name", SENTENCE_FEATURE) != SENTENCE_FEATURE:
                    raise ValueError(f"{where}/config.json: only {SENTENCE_FEATURE!r} can be normalized")
                normalize = True
                continue
            layer = Dense.from_folder(where)
            if layer.linear.in_features != width:
                raise ValueError(
                    f"{where}/config.json: in_features {layer.linear.in_features}, but its input has {width}"
                )
            width = layer.linear.out_features
            dense.append(layer)
        prompts: dict[str, str] = {}
        default_prompt_name = None
        if (folder / PROMPTS_FILE).is_file():
            data = _read_json(folder / PROMPTS_FILE)
            prompts = dict(data.get("prompts") or {})
            default_prompt_name = data.get("default_prompt_name") or None
            if default_prompt_name is not None and default_prompt_name not in prompts:
                raise ValueError(
                    f"{folder}/{PROMPTS_FILE}: default_prompt_name {default_prompt_name!r} is not a prompt"
                )
        return cls(
            pooling,
            dense,
            normalize,
            prompts=prompts,
            default_prompt_name=default_prompt_name,
            max_length=max_length,
            dimension=width,
        )

    def prompt(self, prompt_name: str | None = None, prompt: str | None = None) -> str:
        """The text written before each input: ``prompt``, else the named one, else the default."""
        if prompt is not None and prompt_name is not None:
            raise ValueError("pass prompt_name or prompt, not both")
        if prompt is not None:
            return prompt
        name = self.default_prompt_name if prompt_name is None else prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            known = ", ".join(repr(n) for n in self.prompts) or "none"
            raise ValueError(f"unknown prompt_name {name!r}; this checkpoint's prompts: {known}")
        return self.prompts[name]

    def forward(self, states: torch.Tensor, mask: torch.Tensor, prompt_length: int = 0) -> torch.Tensor:
        """Token states (B, T, H), mask (B, T) of right-padded rows -> sentence vectors (B, D)."""
        vectors = self.pooling(states, mask, prompt_length)
        for layer in self.dense:
            vectors = layer(vectors)
        return F.normalize(vectors, p=2, dim=-1) if self.normalize else vectors


def dense_shapes(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """The sentence-transformers Dense layers' tensor shapes, from ``modules.json`` and each layer's
    ``config.json`` (no weights read): ``{"2_Dense.linear.weight": (3072, 768), ...}``; empty for a
    folder without ``modules.json``. What ``torchgemma info`` counts as the sentence head."""
    folder = Path(folder)
    if not (folder / MODULES_FILE).is_file():
        return {}
    shapes = {}
    for entry in _read_json(folder / MODULES_FILE):
        if MODULE_KINDS.get(entry.get("type")) != "dense":
            continue
        data = _read_json(folder / entry["path"] / "config.json")
        try:
            out_features, in_features = int(data["out_features"]), int(data["in_features"])
        except KeyError as error:
            raise ValueError(f"{folder / entry['path']}/config.json has no {error.args[0]!r}") from error
        shapes[f"{entry['path']}.linear.weight"] = (out_features, in_features)
        if data.get("bias", True):
            shapes[f"{entry['path']}.linear.bias"] = (out_features,)
    return shapes


def _max_length(folder: Path, text: TextConfig) -> int:
    """Most tokens per text, as sentence-transformers decides: ``max_seq_length`` in
    sentence_bert_config.json (what version 5 saved), else the tokenizer's ``model_max_length``
    (what version 6 saves) capped at the model's context."""
    path = folder / "sentence_bert_config.json"
    if path.is_file():
        data = _read_json(path)
        if data.get("do_lower_case"):
            raise ValueError(f"{path}: do_lower_case is not supported")
        task = data.get("transformer_task", "feature-extraction")
        if task != "feature-extraction":
            raise ValueError(f"{path}: transformer_task {task!r} is not a sentence embedder's")
        if data.get("max_seq_length") is not None:
            return int(data["max_seq_length"])
    limit = text.max_position_embeddings
    if (folder / "tokenizer_config.json").is_file():
        limit = min(limit, int(_read_json(folder / "tokenizer_config.json").get("model_max_length", limit)))
    return limit


# ── texts in, vectors out ────────────────────────────────────────────────────────────────────


def check_embedding_rows(
    input_ids: torch.Tensor | Sequence[Sequence[int]],
    tokenizer: Tokenizer,
    rows: int,
    where: str = "the prompt",
) -> None:
    """Refuse a prompt (``where`` names it) that uses a token the model has no embedding row for,
    naming the token.

    A tokenizer may define ids past the model's table: the published EmbeddingGemma and Gemma 3
    270M/1B map ``<image_soft_token>`` (added_tokens.json, tokenizer.json) to 262144, one past their
    262,144 rows, as sentence-transformers and transformers load them. That is legal until a prompt
    uses such an id, which would otherwise fail deep in the model as an IndexError.
    """
    ids = torch.as_tensor(input_ids) if not isinstance(input_ids, torch.Tensor) else input_ids
    past = ids >= rows
    if bool(past.any()):
        token_id = int(ids[past][0])
        name = tokenizer.backend.id_to_token(token_id)
        raise ValueError(
            f"{where} uses token {name!r} (id {token_id}), which the tokenizer defines but the model "
            f"cannot embed: its embedding table has {rows} rows (ids 0-{rows - 1})"
        )


def embed_texts(
    model: Gemma,
    tokenizer: Tokenizer,
    head: SentenceHead,
    texts: str | Sequence[str],
    *,
    prompt_name: str | None = None,
    prompt: str | None = None,
    batch_size: int = 32,
    truncate_dim: int | None = None,
) -> torch.Tensor:
    """Sentence vectors (N, D) of ``texts`` (one text: (D,)), on the model's device, in its dtype.

    The prompt (``prompt``, else ``head.prompts[prompt_name]``, else the default prompt) is written
    before each text. Texts are batched as sentence-transformers batches them (longest first,
    ``batch_size`` at a time) and right-padded; positions count each text's own tokens, so a text's
    vector does not depend on its batch beyond rounding. ``truncate_dim`` keeps the first dimensions
    (Matryoshka), not re-normalized, as sentence-transformers' ``truncate_dim``.
    """
    single = isinstance(texts, str)
    texts = [texts] if single else list(texts)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] is a {type(text).__name__}, not a str")
    if truncate_dim is not None and not 0 < truncate_dim <= head.dimension:
        raise ValueError(f"truncate_dim must be in 1..{head.dimension}, got {truncate_dim}")
    before = head.prompt(prompt_name, prompt)
    prompt_length = 0
    if before and not head.pooling.include_prompt:
        # The prompt's own tokens, less a special token the tokenizer ends every text with.
        ids = _token_ids(tokenizer, before, head.max_length)
        prompt_length = len(ids) - (1 if ids and ids[-1] in tokenizer.special_ids else 0)
    # sentence-transformers' order (numpy's argsort of minus the character counts), so that the
    # batches, and so the vectors, are the same to the bit.
    order = [int(i) for i in np.argsort([-len(text) for text in texts])]
    vectors = _embed_rows(
        model,
        tokenizer,
        head,
        lambda i: _token_ids(tokenizer, before + texts[i], head.max_length),
        order,
        batch_size=batch_size,
        truncate_dim=truncate_dim,
        prompt_length=prompt_length,
        name="texts",
    )
    return vectors[0] if single else vectors


def embed_token_ids(
    model: Gemma,
    tokenizer: Tokenizer,
    head: SentenceHead,
    rows: Sequence[Sequence[int]],
    *,
    batch_size: int = 32,
    truncate_dim: int | None = None,
) -> torch.Tensor:
    """Sentence vectors (N, D) of token-id rows, each taken as the decoder's whole input (as vLLM and
    llama.cpp take them): no task prompt and no special token added; a row longer than the head's
    ``max_length`` is cut to it, as a text's tokens are. Ids must be in the model's vocabulary."""
    rows = [list(row) for row in rows]
    if truncate_dim is not None and not 0 < truncate_dim <= head.dimension:
        raise ValueError(f"truncate_dim must be in 1..{head.dimension}, got {truncate_dim}")
    vocab = model.config.text.vocab_size
    for i, row in enumerate(rows):
        outside = next((t for t in row if not 0 <= t < vocab), None)
        if outside is not None:
            raise ValueError(f"input[{i}] has token id {outside}, outside the vocabulary [0, {vocab})")
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i]))
    return _embed_rows(
        model,
        tokenizer,
        head,
        lambda i: rows[i][: head.max_length],
        order,
        batch_size=batch_size,
        truncate_dim=truncate_dim,
        prompt_length=0,
        name="input",
    )


def _embed_rows(
    model: Gemma,
    tokenizer: Tokenizer,
    head: SentenceHead,
    ids_of: Callable[[int], list[int]],
    order: list[int],
    *,
    batch_size: int,
    truncate_dim: int | None,
    prompt_length: int,
    name: str,
) -> torch.Tensor:
    """(N, D): row ``i``'s ids from ``ids_of(i)``, read ``batch_size`` rows at a time in ``order``,
    right-padded; positions count each row's own tokens."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    pad = tokenizer.special_tokens.get("pad_token")
    pad_id = 0 if pad is None else tokenizer.token_id(pad)
    device = model.device
    vectors: list[torch.Tensor | None] = [None] * len(order)
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            ids = [ids_of(i) for i in rows]
            for i, row in zip(rows, ids):
                if not row:
                    raise ValueError(f"{name}[{i}] has no tokens")
                check_embedding_rows([row], tokenizer, model.config.text.vocab_size, f"{name}[{i}]")
            input_ids, mask = _right_pad(ids, pad_id, device)
            # Media placeholders typed in a text read as the pad token, as in the multimodal reference.
            states = model.language_model(model.text_ids(input_ids), attention_mask=mask, head=False)
            batch = head(states, mask, prompt_length)  # (B, D)
            if truncate_dim is not None:
                batch = batch[:, :truncate_dim]
            for i, vector in zip(rows, batch):
                vectors[i] = vector
    if not vectors:
        return torch.empty((0, truncate_dim or head.dimension), dtype=model.dtype, device=device)
    return torch.stack(vectors)


def token_counts(
    tokenizer: Tokenizer,
    head: SentenceHead,
    texts: Sequence[str],
    *,
    prompt_name: str | None = None,
    prompt: str | None = None,
) -> list[int]:
    """How many tokens ``embed_texts`` runs through the decoder for each text (prompt included,
    after truncation): the server's usage figures."""
    before = head.prompt(prompt_name, prompt)
    return [len(_token_ids(tokenizer, before + text, head.max_length)) for text in texts]


def _token_ids(tokenizer: Tokenizer, text: str, max_length: int) -> list[int]:
    """Ids as transformers' ``tokenizer(text, truncation=True, max_length=...)``: the text's tokens
    cut (at the end) to leave room for the special tokens the tokenizer adds, then those added."""
    backend = tokenizer.backend
    encoding = backend.encode(text, add_special_tokens=False)
    processor = backend.post_processor
    added = processor.num_special_tokens_to_add(False) if processor is not None else 0
    if len(encoding.ids) > max_length - added:
        encoding.truncate(max(max_length - added, 0))
    return backend.post_process(encoding).ids


def _right_pad(rows: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, row in enumerate(rows):
        input_ids[b, : len(row)] = torch.tensor(row, dtype=torch.long)
        mask[b, : len(row)] = 1
    return input_ids.to(device), mask.to(device)
