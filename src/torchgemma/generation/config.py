"""A checkpoint's generation defaults (``generation_config.json``), as plain frozen data.

The model knows nothing of its folder, so whoever loads a checkpoint reads this file beside it and
hands it to ``generate``/``stream`` (``LLM`` does that). Keys follow transformers' GenerationConfig;
a missing key takes transformers' default (``do_sample=False``: greedy).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import TextConfig
from .sampling import SamplingParams

# A reply's limit when neither the call nor generation_config.json gives one. A chat model's reply
# ends at its end of turn; a base model (no chat template) continues until the limit, and greedy
# continuations loop: the real 270M repeats one line from ~60 tokens on (512 tokens: ~5 repeats of a
# paragraph), so a base model's default is a short continuation (the CLI says how to get more).
CHAT_MAX_NEW_TOKENS = 512
BASE_MAX_NEW_TOKENS = 64


@dataclass(frozen=True)
class GenerationConfig:
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float | None = 1.0
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], text: TextConfig | None = None) -> GenerationConfig:
        """From the dict of a ``generation_config.json``; token ids it lacks come from ``text``."""
        eos = data.get("eos_token_id")
        if eos is None and text is not None:
            eos = list(text.eos_token_id)
        eos_ids = () if eos is None else tuple(int(i) for i in ([eos] if isinstance(eos, int) else eos))
        pad = data.get("pad_token_id", None if text is None else text.pad_token_id)
        bos = data.get("bos_token_id", None if text is None else text.bos_token_id)
        # transformers' GenerationConfig defaults for the sampling fields.
        return cls(
            eos_token_ids=eos_ids,
            pad_token_id=None if pad is None else int(pad),
            bos_token_id=None if bos is None else int(bos),
            do_sample=bool(_get(data, "do_sample", False)),
            temperature=float(_get(data, "temperature", 1.0)),
            top_k=_get(data, "top_k", 50),
            top_p=_get(data, "top_p", 1.0),
            min_p=data.get("min_p"),
            repetition_penalty=data.get("repetition_penalty"),
            max_new_tokens=data.get("max_new_tokens"),
        )

    @classmethod
    def from_folder(cls, folder: str | Path, text: TextConfig | None = None) -> GenerationConfig:
        """``folder/generation_config.json`` if present, else only the token ids of ``text``."""
        path = Path(folder) / "generation_config.json"
        if not path.is_file():
            return cls.from_dict({}, text)
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from err
        return cls.from_dict(data, text)

    def reply_limit(self, chat_model: bool) -> int:
        """``max_new_tokens`` when a call gives none: the file's, else 512 for a chat model (one with
        a chat template), else 64."""
        return self.max_new_tokens or (CHAT_MAX_NEW_TOKENS if chat_model else BASE_MAX_NEW_TOKENS)

    def sampling(
        self,
        *,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
        logit_bias: Mapping[int, float] | None = None,
        presence_penalty: float | None = None,
        frequency_penalty: float | None = None,
    ) -> SamplingParams:
        """Sampling parameters: what the caller set, the checkpoint's defaults for the rest.

        Without an explicit temperature the checkpoint's ``do_sample`` decides: its temperature
        when sampling, greedy otherwise. ``temperature=0`` (or below 0.01) is always greedy.
        ``logit_bias`` (token id -> bias in [-100, 100]) and OpenAI's ``presence_penalty`` and
        ``frequency_penalty`` have no checkpoint default.
        """
        if temperature is None:
            temperature = self.temperature if self.do_sample else 0.0
        return SamplingParams(
            temperature=float(temperature),
            top_k=self.top_k if top_k is None else top_k,
            top_p=self.top_p if top_p is None else top_p,
            min_p=self.min_p if min_p is None else min_p,
            repetition_penalty=self.repetition_penalty if repetition_penalty is None else repetition_penalty,
            seed=seed,
            logit_bias=logit_bias,
            presence_penalty=presence_penalty or None,
            frequency_penalty=frequency_penalty or None,
        )


def _get(data: Mapping[str, Any], key: str, default: Any) -> Any:
    # transformers fills keys that are missing or null with its defaults.
    value = data.get(key)
    return default if value is None else value
