"""Images and audio sent by clients -> what the processor takes; a file we cannot read is a 400."""

from __future__ import annotations

import base64
import binascii
import io

from ..processing.audio import decode_wav
from .errors import bad_request


def decode_image(url: str, where: str):
    from PIL import Image, UnidentifiedImageError

    if not url.startswith("data:"):
        raise bad_request(
            "images are taken as data URLs (data:image/png;base64,...); URLs are not fetched", where
        )
    try:
        header, payload = url.split(",", 1)
        if ";base64" not in header:
            raise ValueError("not base64")
        data = base64.b64decode(payload, validate=True)
        image = Image.open(io.BytesIO(data))
        image.load()
    except (
        ValueError,
        binascii.Error,
        UnidentifiedImageError,
        OSError,
        Image.DecompressionBombError,
    ) as error:
        raise bad_request(f"cannot read the image: {error}", where) from error
    return image


def decode_audio(payload: str, fmt: str, where: str):
    if fmt != "wav":
        raise bad_request(f"input_audio format {fmt!r} is not supported; send wav", where)
    try:
        data = base64.b64decode(payload, validate=True)
    except (ValueError, binascii.Error) as error:
        raise bad_request(f"input_audio data is not base64: {error}", where) from error
    return decode_wav_upload(data, where)


def decode_wav_upload(data: bytes, where: str = "file"):
    try:
        return decode_wav(data)
    except ValueError as error:
        raise bad_request(f"cannot read the audio: {error}", where) from error
