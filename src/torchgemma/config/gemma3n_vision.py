"""Gemma 3n's vision tower, MobileNet-V5 (``vision_config``: ``gemma3n_vision``), as frozen data.

transformers builds the tower through timm (``timm.create_model(architecture, **model_args)``);
published checkpoints name ``mobilenetv5_300m_enc`` and no ``model_args``. Its block list lives in
timm's code, written in timm's block notation (``uir_r1_a5_k5_s2_e6_c640``: a universal inverted
residual, depthwise kernels 5 before and 5 in the middle, stride 2, expansion 6, 640 channels). It is
written down here the same way and read into ``MobileNetBlock`` records, one per block. A checkpoint
may replace it (timm's ``model_args``: ``block_args``, decoded blocks as timm takes them,
``stem_size``, ``msfa_output_resolution``): tiny test checkpoints do; any other ``model_args`` key is
refused by name.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from .limits import POSITIVE, check_numbers
from .schema import ConfigError

ARCHITECTURE = "mobilenetv5_300m_enc"

# timm's mobilenetv5_300m_enc (timm/models/mobilenetv5.py, _gen_mobilenet_v5): four stages, each
# starting with a stride-2 block (768 px in: 384, 192, 96, 48, 24 px feature maps).
_UIR_640, _MQA_640 = "uir_r1_a0_k0_s1_e2_c640", "mqa_r1_k3_h12_v2_s1_d64_c640"
_UIR_1280, _MQA_1280 = "uir_r1_a0_k0_s1_e2_c1280", "mqa_r1_k3_h16_s1_d96_c1280"
MOBILENETV5_300M: tuple[tuple[str, ...], ...] = (
    ("er_r1_k3_s2_e4_c128", "er_r1_k3_s1_e4_c128", "er_r1_k3_s1_e4_c128"),
    (
        "uir_r1_a3_k5_s2_e6_c256",
        "uir_r1_a5_k0_s1_e4_c256",
        "uir_r1_a3_k0_s1_e4_c256",
        "uir_r1_a5_k0_s1_e4_c256",
        "uir_r1_a3_k0_s1_e4_c256",
    ),
    (
        "uir_r1_a5_k5_s2_e6_c640",
        *["uir_r1_a5_k0_s1_e4_c640"] * 7,
        "uir_r1_a0_k0_s1_e1_c640",
        *[_MQA_640, _UIR_640] * 14,
    ),
    ("uir_r1_a5_k5_s2_e6_c1280", *[_MQA_1280, _UIR_1280] * 19),
)
# timm builds every stride through the network up to 32 (beyond it, strides turn into dilations,
# which this tower does not implement).
MAX_OUTPUT_STRIDE = 32
# The adapter's (MSFA) output channels: fixed in timm's MobileNetV5Encoder.
MSFA_CHANNELS = 2048
MAX_CHANNELS = 65_536


@dataclass(frozen=True)
class MobileNetBlock:
    """One block of MobileNet-V5 (timm's block notation in brackets).

    ``kind``: ``"er"`` (edge residual: a full k x k expansion conv, then a 1x1 projection), ``"uir"``
    (universal inverted residual: optional depthwise convs before, in the middle of and after a 1x1
    expansion and projection) or ``"mqa"`` (multi-query attention, keys and values shared by the
    heads, optionally downsampled by a strided depthwise conv).
    """

    kind: str
    out_channels: int  # (c)
    stride: int  # (s) 1 or 2; only a stage's first block strides
    expansion: float = 1.0  # (e) er, uir: hidden channels = in_channels x expansion, rounded to 8
    kernel: int = 0  # (k) er: the expansion conv; uir: the middle depthwise conv; mqa: the kv one
    start_kernel: int = 0  # (a) uir: depthwise conv before the expansion (0: none)
    end_kernel: int = 0  # (p) uir: depthwise conv after the projection (0: none)
    num_heads: int = 0  # (h) mqa
    key_dim: int = 0  # (d) mqa: query and key width per head, and the value width
    kv_stride: int = 1  # (v) mqa: keys and values computed on a grid this many times coarser
    noskip: bool = False  # no residual connection even where the shapes allow one


@dataclass(frozen=True)
class Gemma3nVisionConfig:
    """MobileNet-V5 and how its soft tokens enter the prompt."""

    stages: tuple[tuple[MobileNetBlock, ...], ...]
    stem_channels: int
    # The multi-scale fusion adapter's output grid (side) and channels: the soft tokens per image
    # are its side squared, each of hidden_size values.
    msfa_output_resolution: int
    hidden_size: int
    rms_norm_eps: float  # the tower's RMS norms (timm's RmsNorm2d default); the embedder's own eps
    soft_tokens_per_image: int
    image_token_id: int

    @property
    def msfa_stages(self) -> tuple[int, int]:
        """The adapter fuses the outputs of the last two stages (timm's msfa_indices (-2, -1))."""
        return len(self.stages) - 2, len(self.stages) - 1


def make_divisible(value: float, divisor: int = 8) -> int:
    """timm's channel rounding: to the nearest multiple of 8, never more than 10% down."""
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


_NOTATION = re.compile(r"([a-z]+)(\d.*)")
_NOTATION_FIELDS = {
    "er": {"r", "k", "s", "e", "c"},
    "uir": {"r", "a", "k", "p", "s", "e", "c"},
    "mqa": {"r", "k", "h", "v", "s", "d", "c"},
}


def block_from_notation(text: str) -> MobileNetBlock:
    """A block from timm's notation: the kind, then ``_``-separated letter-number options."""
    kind, *options = text.split("_")
    fields = {}
    for option in options:
        match = _NOTATION.fullmatch(option)
        if kind not in _NOTATION_FIELDS or not match or match[1] not in _NOTATION_FIELDS[kind]:
            raise ConfigError(f"MobileNet-V5 block {text!r}: {option!r} is not an option torchgemma builds")
        fields[match[1]] = match[2]
    if fields.pop("r", "1") != "1":
        raise ConfigError(f"MobileNet-V5 block {text!r}: repeats other than r1 are not used")
    number = {key: (float(v) if key == "e" else int(v)) for key, v in fields.items()}
    return MobileNetBlock(
        kind=kind,
        out_channels=number["c"],
        stride=number["s"],
        expansion=number.get("e", 1.0),
        kernel=number.get("k", 0),
        start_kernel=number.get("a", 0),
        end_kernel=number.get("p", 0),
        num_heads=number.get("h", 0),
        key_dim=number.get("d", 0),
        kv_stride=number.get("v", 1),
    )


# timm's decoded block arguments (model_args' block_args) -> MobileNetBlock fields, per kind; the
# values a key must have where torchgemma builds only timm's default.
_DECODED_FIELDS = {
    "er": {"exp_kernel_size": "kernel", "exp_ratio": "expansion"},
    "uir": {
        "dw_kernel_size_start": "start_kernel",
        "dw_kernel_size_mid": "kernel",
        "dw_kernel_size_end": "end_kernel",
        "exp_ratio": "expansion",
    },
    "mqa": {
        "dw_kernel_size": "kernel",
        "num_heads": "num_heads",
        "key_dim": "key_dim",
        "kv_stride": "kv_stride",
    },
}
_DECODED_DEFAULTS = {"act_layer": None, "se_ratio": 0.0, "force_in_chs": 0, "pw_kernel_size": 1}


def block_from_decoded(args: Any, where: str) -> MobileNetBlock:
    """A block from timm's decoded form (``decode_arch_def``), as ``model_args.block_args`` holds it."""
    if not isinstance(args, dict) or args.get("block_type") not in _DECODED_FIELDS:
        raise ConfigError(f"{where} must be a timm block (block_type 'er', 'uir' or 'mqa'), got {args!r}")
    kind = args["block_type"]
    fields: dict[str, Any] = {"kind": kind}
    for key, value in args.items():
        if key in ("block_type", "out_chs", "stride", "noskip"):
            continue
        if key in _DECODED_FIELDS[kind]:
            fields[_DECODED_FIELDS[kind][key]] = value
        elif key == "value_dim" and kind == "mqa" and value == args.get("key_dim"):
            continue
        elif key not in _DECODED_DEFAULTS or value != _DECODED_DEFAULTS[key]:
            raise ConfigError(f"{where}: {key}={value!r} is not a block setting torchgemma builds")
    fields.update(
        out_channels=args.get("out_chs"), stride=args.get("stride"), noskip=args.get("noskip", False)
    )
    return MobileNetBlock(**fields)


def _check_blocks(stages: tuple[tuple[MobileNetBlock, ...], ...], where: str) -> None:
    if len(stages) < 2 or any(not stage for stage in stages):
        raise ConfigError(
            f"{where}: MobileNet-V5 needs at least two stages of blocks (the adapter fuses two)"
        )
    stride = 2  # the stem's
    for s, stage in enumerate(stages):
        for i, block in enumerate(stage):
            name = f"{where}: block {s}.{i}"
            ints = (block.out_channels, block.kernel, block.start_kernel, block.end_kernel, block.num_heads)
            ints += (block.key_dim, block.kv_stride, block.stride)
            if any(isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_CHANNELS for v in ints):
                raise ConfigError(f"{name} has a size that is not an integer in [0, {MAX_CHANNELS}]: {block}")
            if block.out_channels < 1 or block.stride not in (1, 2) or (i > 0 and block.stride != 1):
                raise ConfigError(
                    f"{name}: needs channels >= 1 and stride 1 (2 only for a stage's first block)"
                )
            expansion = block.expansion
            if (
                isinstance(expansion, bool)
                or not isinstance(expansion, int | float)
                or not 0 < expansion <= 64
            ):
                raise ConfigError(f"{name}: expansion must be in (0, 64], got {expansion!r}")
            if block.kind == "mqa" and (block.num_heads < 1 or block.key_dim < 1 or block.kv_stride < 1):
                raise ConfigError(f"{name}: attention needs heads, key_dim and kv_stride >= 1")
            if block.kind == "mqa" and block.kv_stride > 1 and block.kernel < 1:
                raise ConfigError(f"{name}: a kv_stride > 1 needs a depthwise kernel")
            if block.kind == "er" and block.kernel < 1:
                raise ConfigError(f"{name}: the edge residual needs an expansion kernel")
            if (
                block.kind == "uir"
                and block.stride > 1
                and not block.kernel | block.start_kernel | block.end_kernel
            ):
                raise ConfigError(f"{name}: a strided block needs a depthwise kernel")
            stride *= block.stride
        if stage[-1].kind == "mqa":
            raise ConfigError(f"{where}: stage {s} ends with an attention block, which timm cannot tap")
    if stride > MAX_OUTPUT_STRIDE:
        raise ConfigError(f"{where}: the blocks stride by {stride} in all, more than {MAX_OUTPUT_STRIDE}")
    for s in range(1, len(stages)):
        if stages[s][0].stride != 2:
            raise ConfigError(f"{where}: stage {s} must start with a stride-2 block (a feature level)")


def vision_config_from_hf(data: Any, top: dict) -> Gemma3nVisionConfig:
    """Gemma 3n's vision_config (null: transformers' defaults) and the top level's vision fields."""
    where = "vision_config"
    v = {k: val for k, val in (data or {}).items() if val is not None}
    architecture = v.get("architecture", ARCHITECTURE)
    if architecture != ARCHITECTURE:
        raise ConfigError(f"{where}: architecture {architecture!r}; torchgemma builds {ARCHITECTURE!r} only")
    check_numbers(v, {"rms_norm_eps": POSITIVE}, where)
    args = v.get("model_args") or {}
    if not isinstance(args, dict):
        raise ConfigError(f"{where}: model_args must be an object or null")
    unknown = set(args) - {"block_args", "stem_size", "msfa_output_resolution"}
    if unknown:
        raise ConfigError(
            f"{where}: model_args {sorted(unknown)} are timm settings torchgemma does not build"
        )
    if "block_args" in args:
        stages_data = args["block_args"]
        if not isinstance(stages_data, list) or not all(isinstance(s, list) for s in stages_data):
            raise ConfigError(f"{where}: model_args.block_args must be a list of stages (lists of blocks)")
        stages = tuple(
            tuple(block_from_decoded(b, f"{where}: block_args[{s}][{i}]") for i, b in enumerate(stage))
            for s, stage in enumerate(stages_data)
        )
    else:
        stages = tuple(tuple(block_from_notation(b) for b in stage) for stage in MOBILENETV5_300M)
    _check_blocks(stages, where)
    # timm rounds every block's channels as it builds them (to multiples of 8).
    stages = tuple(
        tuple(dataclasses.replace(b, out_channels=make_divisible(b.out_channels)) for b in stage)
        for stage in stages
    )
    sizes = {
        "stem_size": args.get("stem_size", 64),
        "msfa_output_resolution": args.get("msfa_output_resolution", 16),
        "hidden_size": v.get("hidden_size", MSFA_CHANNELS),
        "vision_soft_tokens_per_image": top.get("vision_soft_tokens_per_image", 256),
        "image_token_id": top.get("image_token_id", 262_145),
    }
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= 2**24:
            raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    if sizes["hidden_size"] != MSFA_CHANNELS:
        raise ConfigError(
            f"{where}: hidden_size {sizes['hidden_size']}, but MobileNet-V5's adapter gives {MSFA_CHANNELS} channels"
        )
    side = sizes["msfa_output_resolution"]
    if sizes["vision_soft_tokens_per_image"] != side * side:
        raise ConfigError(
            f"vision_soft_tokens_per_image is {sizes['vision_soft_tokens_per_image']}, but the vision tower "
            f"gives {side}x{side} = {side * side} soft tokens per image"
        )
    return Gemma3nVisionConfig(
        stages=stages,
        stem_channels=make_divisible(sizes["stem_size"]),
        msfa_output_resolution=side,
        hidden_size=MSFA_CHANNELS,
        rms_norm_eps=1e-6,
        soft_tokens_per_image=side * side,
        image_token_id=sizes["image_token_id"],
    )
