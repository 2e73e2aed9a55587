"""The ``torchgemma`` command: a thin layer over the library.

Arguments are checked before the model loads, and every failure is one line on stderr,
``torchgemma CMD: error: ...``, with exit status 2 (``--verbose`` adds the traceback of a failure
nobody anticipated).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import torch

from .config import ConfigError
from .llm import DEFAULT_MAX_NEW_TOKENS
from .weights.loading import resolve_dtype

# Decode on a CPU is a chain of small matrix products with a barrier after each; when another
# process holds one of the threads' cores, every barrier waits for it. gemma3-270m decode on a shared
# 2-core machine (other work running, load average 2-8; medians of 5 runs of 32-48 tokens): 1 thread
# 4.6 tok/s, 2 threads 1.3 tok/s; with a busy loop on one core as well, 1.8 vs 0.55. Half the cores
# (the physical ones where cores are hyperthreads) leaves room for whatever else runs.
THREADS_HELP = (
    "CPU threads for the model (default: half the cores this process may use, at least 1; "
    "gemma3-270m decode on a busy 2-core machine: 1 thread 4.6 tok/s, 2 threads 1.3 tok/s)"
)

# Flags that only matter when sampling: given without --temperature they switch sampling on.
SAMPLING_ONLY = ("top_k", "top_p", "min_p", "seed")


class CLIError(Exception):
    """A failure the user can fix, reported as one line: ``torchgemma CMD: error: MESSAGE``."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: the message and where the help is, not the whole usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torchgemma")
    except PackageNotFoundError:
        return "unknown (not installed; run from a source tree)"


def default_threads() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // 2)


# ---- argument types: each rejects a bad value at parse time, before anything loads ------------------


def _int_at_least(low: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in "invalid int value"
    return parse


def _float_where(check, rule: str):
    def parse(text: str) -> float:
        value = float(text)
        if not (math.isfinite(value) and check(value)):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    parse.__name__ = "float"
    return parse


def _dtype(text: str) -> str:
    try:
        resolve_dtype(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _device(text: str) -> str:
    if text == "auto":
        return text
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"unknown device {text!r}; use auto, cpu, cuda, cuda:N or mps"
        ) from None
    if device.type not in ("cpu", "cuda", "mps"):
        raise argparse.ArgumentTypeError(f"torchgemma runs on cpu, cuda or mps, not {text!r}")
    return text


def resolve_device(name: str) -> str:
    """``auto`` is CUDA when there is a GPU, else the CPU; a named device must be there."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = (
                f"this torch ({torch.__version__}) is a CPU-only build"
                if torch.version.cuda is None
                else "no CUDA GPU was found"
            )
            raise CLIError(f"--device {name}: CUDA is not available ({why}); use --device cpu or auto")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise CLIError(
                f"--device {name}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}"
            )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise CLIError(
            f"--device {name}: Apple's MPS backend is not available here; use --device cpu or auto"
        )
    return name


# ---- shared steps ----------------------------------------------------------------------------------


def _utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CLIError(
            f"{where} is not UTF-8 text ({err.reason}: byte 0x{data[err.start]:02x} at offset {err.start})"
        ) from None


def _check_text(text: str, where: str) -> str:
    # A terminal in a non-UTF-8 locale hands Python undecodable bytes as lone surrogates.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise CLIError(f"{where} is not UTF-8 text (undecodable bytes at character {err.start})") from None
    return text


def _check_media_files(args: argparse.Namespace) -> None:
    """Before the model loads, so that a typo or a bad file fails at once: images are opened (header
    only: format, size, the decompression-bomb check), audio is read, videos' headers are read."""
    from PIL import Image

    for path in args.image:
        if not Path(path).expanduser().is_file():
            raise CLIError(f"image file not found: {path!r}")
        try:
            with Image.open(Path(path).expanduser()):
                pass
        except Image.DecompressionBombError as err:
            raise CLIError(f"image {path!r} is too large to decode safely: {err}") from None
        except OSError as err:  # PIL's UnidentifiedImageError is an OSError
            raise CLIError(f"cannot read image {path!r}: {err}") from None
    if args.audio:
        from .processing.audio import load_audio

        for path in args.audio:
            if not Path(path).expanduser().is_file():
                raise CLIError(f"audio file not found: {path!r}")
            # Reads the header and one frame: its errors name the file (and a missing soundfile).
            load_audio(Path(path).expanduser(), max_frames=1)
    if args.video:
        from .processing.video import probe_video

        for path in args.video:
            if not Path(path).expanduser().is_file():
                raise CLIError(f"video file not found: {path!r}")
            probe_video(path)  # its errors name the file (and the video extra when PyAV is missing)


def _prepare(args: argparse.Namespace) -> None:
    """What parsing cannot check, short of loading the model."""
    _check_media_files(args)
    args.device = resolve_device(args.device)
    if args.threads is None:
        args.threads = default_threads()


@contextmanager
def _hub_progress_bars(shown: bool) -> Iterator[None]:
    """Hide huggingface_hub's download bars for --quiet (the loader's bar is LLM's progress=)."""
    if shown:
        yield
        return
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    hub_bars = not are_progress_bars_disabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if hub_bars:
            enable_progress_bars()


def _load_llm(args: argparse.Namespace):
    from .llm import LLM

    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    with _hub_progress_bars(not args.quiet):
        llm = LLM(
            args.model,
            dtype=args.dtype,
            device=args.device,
            attention=args.attention,
            progress=not args.quiet,
            quantize=None if args.quantize == "none" else args.quantize,
            activations=None if args.activations == "float" else args.activations,
        )
    if args.compile:
        from .acceleration import compile

        compile(llm.model)
    if args.verbose:
        print(
            f"loaded {args.model} in {time.perf_counter() - start:.1f} s: {llm.model.device}, "
            f"{str(llm.model.dtype).removeprefix('torch.')}{_quantized(llm.model)}, "
            f"{torch.get_num_threads()} CPU thread(s), "
            f"context {llm.context_length:,} tokens",
            file=sys.stderr,
        )
    return llm


def _quantized(model) -> str:
    quantization = getattr(model, "quantization", None)
    if not quantization:
        return ""
    bits = max((getattr(m, "activation_bits", 0) for m in model.modules()), default=0)
    prefill = f" (int{bits} in prefill products)" if bits else ""
    return f" activations{prefill}, {quantization['mode']} weights ({len(quantization['layers'])} layers)"


def _sampling(args: argparse.Namespace, llm) -> dict:
    """The sampling flags the user gave; the rest fall back to the checkpoint's defaults.

    --top-k, --top-p, --min-p or --seed without --temperature mean sampling: when the checkpoint's
    default is greedy decoding they would change nothing, so they sample at temperature 1.
    """
    names = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seed")
    chosen = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    sampling_only = [name for name in SAMPLING_ONLY if name in chosen]
    if sampling_only and "temperature" not in chosen and not llm.generation_config.do_sample:
        chosen["temperature"] = 1.0
    elif sampling_only and chosen.get("temperature") == 0 and not args.quiet:
        flags = ", ".join("--" + name.replace("_", "-") for name in sampling_only)
        print(
            f"torchgemma {args.command}: note: {flags} do nothing with --temperature 0 (greedy)",
            file=sys.stderr,
        )
    return chosen


def _report(stats, out) -> None:
    print(
        f"prompt: {stats.prompt_tokens} tokens, {stats.prefill_tokens_per_second:.1f} tok/s | "
        f"decode: {stats.steps} tokens, {stats.decode_tokens_per_second:.1f} tok/s",
        file=out,
        flush=True,
    )


# ---- info ------------------------------------------------------------------------------------------


def cmd_info(args: argparse.Namespace) -> int:
    from .info import checkpoint_config, describe, format_report, sentence_head_shapes

    if args.path is not None and args.model is not None:
        args.parser.error("give the checkpoint once: as an argument or with --model")
    source = args.path if args.path is not None else args.model
    if source is None:
        args.parser.error("which checkpoint? e.g. torchgemma info gemma3-270m")
    info = describe(
        checkpoint_config(source),
        context=args.context,
        batch=args.batch,
        dtype=resolve_dtype(args.dtype),
        max_rollback=args.max_rollback,
        sentence_head=sentence_head_shapes(source),
    )
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    return 0


# ---- generate --------------------------------------------------------------------------------------

IMAGE_PLACEHOLDER, AUDIO_PLACEHOLDER, VIDEO_PLACEHOLDER = "<|image|>", "<|audio|>", "<|video|>"


def with_placeholders(prompt: str, images: list[str], audio: list[str], videos: list[str] = ()) -> str:
    """The raw prompt with one placeholder per file appended, for a kind the prompt has none of."""
    if images and IMAGE_PLACEHOLDER not in prompt:
        prompt += IMAGE_PLACEHOLDER * len(images)
    if audio and AUDIO_PLACEHOLDER not in prompt:
        prompt += AUDIO_PLACEHOLDER * len(audio)
    if videos and VIDEO_PLACEHOLDER not in prompt:
        prompt += VIDEO_PLACEHOLDER * len(videos)
    return prompt


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return _check_text(args.prompt, "the prompt")
    if sys.stdin is None or sys.stdin.isatty():
        # Nothing piped in: waiting for a terminal's EOF would look like a hang.
        args.parser.print_usage(sys.stderr)
        raise CLIError("no prompt: give it as an argument, or pipe it on stdin")
    if hasattr(sys.stdin, "buffer"):
        return _utf8(sys.stdin.buffer.read(), "stdin")
    return _check_text(sys.stdin.read(), "stdin")


def cmd_generate(args: argparse.Namespace) -> int:
    from .generation import GenerationStats

    prompt = with_placeholders(_read_prompt(args), args.image, args.audio, args.video)
    _prepare(args)
    start = time.perf_counter()
    llm = _load_llm(args)
    load_seconds = time.perf_counter() - start
    if args.audio and llm.model.config.gemma3n_audio is not None:
        # Gemma 3n's tokenizer spells its audio placeholder its own way (<audio_soft_token>).
        prompt = prompt.replace(AUDIO_PLACEHOLDER, llm.tokenizer.backend.id_to_token(llm.tokenizer.audio_id))
    stats = GenerationStats()
    options = dict(images=args.image, audio=args.audio, videos=args.video)
    options.update(max_new_tokens=args.max_new_tokens, stats=stats)
    options.update(_sampling(args, llm))
    if args.json:
        ids = llm.generate_ids([llm._encode_prompt(prompt, args.audio)], **options)[0]
        print(json.dumps(_json_result(llm, ids, stats, load_seconds), ensure_ascii=False), flush=True)
        return 0
    for piece in llm.stream(prompt, **options):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not args.quiet:
        _report(stats, sys.stderr)
    return 0


def _json_result(llm, ids: list[int], stats, load_seconds: float) -> dict:
    stopped = bool(ids) and ids[-1] in llm.generation_config.eos_token_ids

    def number(x: float) -> float | None:  # JSON has no NaN
        return None if math.isnan(x) else round(x, 4)

    return {
        "text": llm.tokenizer.decode(ids[:-1] if stopped else ids),
        "token_ids": ids,  # the stop token included
        "finish_reason": "stop" if stopped else "length",
        "prompt_tokens": stats.prompt_tokens,
        "new_tokens": len(ids),
        "timings": {
            "load_seconds": number(load_seconds),
            "prefill_seconds": number(stats.prefill_seconds),
            "decode_seconds": number(stats.decode_seconds),
            "prefill_tokens_per_second": number(stats.prefill_tokens_per_second),
            "decode_tokens_per_second": number(stats.decode_tokens_per_second),
        },
    }


# ---- chat ------------------------------------------------------------------------------------------

CHAT_HELP = """\
/help          this list
/clear         forget the conversation (the system prompt stays; --image/--audio/--video files join the next message)
/system TEXT   set the system prompt (/system alone removes it)
/exit          end the chat (or Ctrl-D)
Ctrl-C stops a reply and keeps the conversation; at the prompt it ends the chat.
A message that starts with / : type it as //..."""


def _read_template(path: str) -> str:
    file = Path(path).expanduser()
    if not file.is_file():
        raise CLIError(f"chat template file not found: {path!r}")
    return _utf8(file.read_bytes(), f"chat template {path!r}")


def cmd_chat(args: argparse.Namespace) -> int:
    template = _read_template(args.chat_template) if args.chat_template else None
    _prepare(args)
    llm = _load_llm(args)
    if template is not None:
        llm.tokenizer.chat_template = template
    if not llm.tokenizer.chat_template:
        raise CLIError(
            f"{args.model} is a base model without a chat template; use `torchgemma generate`, "
            "or pass --chat-template FILE"
        )
    return Chat(llm, args).run()


class Chat:
    """One conversation: reads user lines, streams replies, keeps the history within the context."""

    def __init__(self, llm, args: argparse.Namespace) -> None:
        self.llm, self.args = llm, args
        self.system: str | None = args.system
        self.turns: list[dict] = []  # user and assistant messages, oldest first
        self.media = [{"type": "image", "image": p} for p in args.image]
        self.media += [{"type": "audio", "audio": p} for p in args.audio]
        self.media += [{"type": "video", "video": p} for p in args.video]
        self.sampling = _sampling(args, llm)
        # Control-token strings typed in a message stay text unless the user says otherwise.
        self.rendering = dict(
            enable_thinking=args.think, sanitize_control_tokens=not args.allow_control_tokens
        )
        self.max_len = min(args.max_len or llm.context_length, llm.context_length)
        self.reply_tokens = (
            args.max_new_tokens or llm.generation_config.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        )
        self.interactive = sys.stdin.isatty()

    def messages(self) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + self.turns

    def _user_message(self, text: str) -> dict:
        # Media join the first user message (before its text, as in Gemma's own examples).
        attach = self.media if not any(m["role"] == "user" for m in self.turns) else []
        return {"role": "user", "content": [*attach, {"type": "text", "text": text}] if attach else text}

    def check_template(self) -> None:
        """Render a first exchange now, so that a template that cannot fails before the first message."""
        self.llm.chat_ids([*self.messages(), self._user_message("Hello")], **self.rendering)

    def run(self) -> int:
        self.check_template()
        if self.interactive:
            with suppress(ImportError):  # no readline on Windows
                import readline  # noqa: F401  (line editing and history for input())
            if not self.args.quiet:
                print(
                    f"torchgemma chat: {self.args.model}, {self.max_len:,} tokens of context. "
                    "/help for commands, /exit or Ctrl-D to end.",
                    file=sys.stderr,
                )
        while True:
            try:
                line = self._read_line()
            except KeyboardInterrupt:  # Ctrl-C at the prompt ends the chat
                print(file=sys.stderr)
                return 130
            if line is None:  # EOF
                return 0
            if not line.strip():
                continue
            if line.startswith("/") and not line.startswith("//"):
                if self.command(line.strip()) == "exit":
                    return 0
                continue
            self.reply(line[1:] if line.startswith("//") else line)

    def _read_line(self) -> str | None:
        if self.interactive and sys.stdout.isatty():
            try:
                return _check_text(input("> "), "the message")
            except EOFError:
                print(file=sys.stderr)
                return None
        if self.interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        if hasattr(sys.stdin, "buffer"):
            data = sys.stdin.buffer.readline()
            line = _utf8(data, "stdin") if data else None
        else:
            line = _check_text(sys.stdin.readline(), "stdin") or None
        return None if line is None else line.rstrip("\r\n")

    def command(self, line: str) -> str | None:
        name, _, rest = line.partition(" ")
        if name in ("/exit", "/quit"):
            return "exit"
        if name == "/help":
            print(CHAT_HELP, file=sys.stderr)
        elif name == "/clear":
            self.turns.clear()
            print("[conversation cleared]", file=sys.stderr)
        elif name == "/system":
            before, self.system = self.system, rest.strip() or None
            try:
                self.check_template()
            except Exception as err:
                self.system = before
                print(
                    f"torchgemma chat: error: the chat template refuses this system prompt: {_one_line(err)}",
                    file=sys.stderr,
                )
                return None
            print("[system prompt set]" if self.system else "[system prompt removed]", file=sys.stderr)
        else:
            print(f"unknown command {name} (/help lists them; //text sends /text)", file=sys.stderr)
        return None

    def reply(self, text: str) -> None:
        from .generation import GenerationStats

        self.turns.append(self._user_message(text))
        budget = self._fit()
        if budget is None:
            self.turns.pop()
            return
        stats = GenerationStats()
        chunks = self.llm.stream_chat(
            self.messages(), **self.rendering, max_new_tokens=budget, stats=stats, **self.sampling
        )
        answer, in_thought = [], False
        try:
            for chunk in chunks:
                # Thinking goes to stderr so that stdout carries the answers alone.
                if chunk.thinking and not in_thought:
                    print("[thinking] ", end="", file=sys.stderr)
                elif in_thought and not chunk.thinking:
                    print(file=sys.stderr)
                in_thought = chunk.thinking
                print(chunk.text, end="", file=sys.stderr if chunk.thinking else sys.stdout, flush=True)
                if not chunk.thinking:
                    answer.append(chunk.text)
        except KeyboardInterrupt:  # Ctrl-C stops the reply; what came so far stays in the conversation
            chunks.close()
            print("\n[reply stopped]", end="", file=sys.stderr, flush=True)
        if in_thought:
            print(file=sys.stderr)
        print(flush=True)
        self.turns.append({"role": "assistant", "content": "".join(answer)})
        if self.args.verbose:
            _report(stats, sys.stderr)

    def _prompt_length(self) -> int:
        inputs = self.llm.chat_inputs(self.messages(), **self.rendering)
        return int(inputs["input_ids"].shape[-1])

    def _fit(self) -> int | None:
        """Drop the oldest turns until the conversation and a reply fit the context; the reply's token
        budget, or None when the newest message alone does not fit."""
        # Room kept for the reply: max-new-tokens, but never more than half the context.
        room = min(self.reply_tokens, self.max_len // 2)
        dropped = 0
        length = self._prompt_length()
        while length + room > self.max_len and len(self.turns) > 1:
            # The oldest user message and the replies up to the next user message.
            cut = next(i for i in range(1, len(self.turns)) if self.turns[i]["role"] == "user")
            del self.turns[:cut]
            dropped += cut
            length = self._prompt_length()
        if dropped:
            print(
                f"[dropped the {dropped} oldest messages to fit the context of {self.max_len:,} tokens"
                f"{'; the system prompt stays' if self.system else ''}]",
                file=sys.stderr,
            )
        if length >= self.max_len:
            message = (
                f"this message takes {length:,} tokens{' with the system prompt' if self.system else ''}, "
                f"more than the context of {self.max_len:,}"
            )
            if not self.interactive:  # a script must see the failure in the exit status
                raise CLIError(message)
            print(f"torchgemma chat: error: {message}; it was not sent", file=sys.stderr)
            return None
        return min(self.reply_tokens, self.max_len - length)


# ---- the parser ------------------------------------------------------------------------------------


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="checkpoint folder, hub repository id, .gguf file, or a named model (gemma3-270m)",
    )
    parser.add_argument(
        "--dtype",
        type=_dtype,
        default=None,
        help="bf16 or fp32 (default: the checkpoint's; float16 overflows Gemma)",
    )
    parser.add_argument(
        "--device",
        type=_device,
        default="auto",
        help="auto (default: CUDA when there is a GPU, else cpu), cpu, cuda, cuda:1, mps",
    )
    parser.add_argument(
        "--threads",
        type=_int_at_least(1),
        default=None,
        metavar="N",
        help=THREADS_HELP,
    )
    parser.add_argument(
        "--attention",
        choices=["sdpa", "eager"],
        default="sdpa",
        help="attention backend: sdpa (default, fast) or eager (transformers' arithmetic to the bit)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="compile the decode step (torch.compile; CUDA graphs on CUDA): minutes to start, faster steps",
    )
    parser.add_argument(
        "--quantize",
        choices=["auto", "int8", "int4", "gguf", "none"],
        default="auto",
        help="weight-only quantization of the text decoder: int8, int4, gguf (a .gguf file's own blocks), "
        "none; auto (default): gguf for the named model gemma3-270m, else none",
    )
    parser.add_argument(
        "--activations",
        choices=["auto", "float", "int16", "int8"],
        default="auto",
        help="a quantized model's prefill on the CPU: int16 (float32's accuracy, ~1.6x faster with AVX-512 "
        "VNNI), int8 (llama.cpp's arithmetic: ~2.2x, slightly less accurate), float (the model's dtype); "
        "auto (default): int16 where the CPU has AVX-512 VNNI, else float",
    )


def _add_generation_flags(parser: argparse.ArgumentParser, quiet: str, verbose: str) -> None:
    _add_model_flags(parser)
    parser.add_argument(
        "--max-new-tokens",
        type=_int_at_least(1),
        default=None,
        metavar="N",
        help="most tokens per reply (default: the checkpoint's, else 512)",
    )
    talk = parser.add_mutually_exclusive_group()
    talk.add_argument("-q", "--quiet", action="store_true", help=quiet)
    talk.add_argument("-v", "--verbose", action="store_true", help=verbose)
    sampling = parser.add_argument_group(
        "sampling",
        "unset flags take the checkpoint's generation_config.json defaults (none: greedy); --top-k, "
        "--top-p, --min-p or --seed without --temperature sample at temperature 1 when that default is greedy",
    )
    sampling.add_argument(
        "--temperature", type=_float_where(lambda v: v >= 0, ">= 0"), default=None, help="0 is greedy"
    )
    sampling.add_argument(
        "--top-k", type=_int_at_least(0), default=None, help="keep the k most likely tokens (0: off)"
    )
    sampling.add_argument(
        "--top-p",
        type=_float_where(lambda v: 0 < v <= 1, "in (0, 1]"),
        default=None,
        help="nucleus: keep this probability mass, in (0, 1]",
    )
    sampling.add_argument(
        "--min-p",
        type=_float_where(lambda v: 0 <= v <= 1, "in [0, 1]"),
        default=None,
        help="drop tokens below min-p x the top one, in [0, 1]",
    )
    sampling.add_argument(
        "--repetition-penalty",
        type=_float_where(lambda v: v > 0, "> 0"),
        default=None,
        help="> 1 discourages repeats (also when greedy)",
    )
    sampling.add_argument("--seed", type=int, default=None, help="make sampling reproducible")


def _add_media_flags(parser: argparse.ArgumentParser, where: str) -> None:
    media = parser.add_argument_group("media", f"images, audio and videos (repeatable); {where}")
    media.add_argument(
        "--image", action="append", default=[], metavar="PATH", help="an image file (PNG, JPEG, ...)"
    )
    media.add_argument(
        "--audio",
        action="append",
        default=[],
        metavar="PATH",
        help="an audio file (WAV; FLAC/OGG/MP3 need soundfile)",
    )
    media.add_argument(
        "--video",
        action="append",
        default=[],
        metavar="PATH",
        help="a video file (MP4, WebM, ...; needs PyAV: pip install 'torchgemma[video]')",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="torchgemma", description="Gemma 4 in PyTorch, exact against transformers.")
    parser.add_argument("--version", action="version", version=f"torchgemma {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    info = commands.add_parser(
        "info",
        help="parameter counts and memory of a checkpoint, from its config alone",
        description="Parameter counts (total, per tower, PLE table, effective, active per token for "
        "mixtures of experts) and memory (weights at bf16/int8/int4, the KV cache torchgemma allocates) "
        "from a checkpoint's config.json or GGUF metadata; no weights are read (a hub id fetches config.json alone).",
    )
    info.add_argument(
        "path",
        nargs="?",
        default=None,
        help="what generate's --model takes (folder, .gguf file, hub id, gemma3-270m), or a config.json file",
    )
    info.add_argument("--model", default=None, help="the same, as a flag")
    info.add_argument(
        "--context",
        type=_int_at_least(1),
        default=None,
        help="tokens per sequence (default: the model's maximum)",
    )
    info.add_argument("--batch", type=_int_at_least(1), default=1, help="sequences in the cache (default: 1)")
    info.add_argument(
        "--dtype",
        type=_dtype,
        default=None,
        help="KV cache dtype: bf16, fp16 or fp32 (default: the checkpoint's)",
    )
    info.add_argument(
        "--max-rollback",
        type=_int_at_least(0),
        default=0,
        help="tokens a sequence can take back (speculative decoding): slack in the sliding layers' ring",
    )
    info.add_argument("--json", action="store_true", help="print a JSON object")
    info.set_defaults(func=cmd_info, parser=info)

    generate = commands.add_parser(
        "generate",
        help="continue a prompt, streaming the text to stdout",
        description="Continue a raw prompt (no chat template), streaming the text to stdout; prompt and "
        "decode speeds go to stderr at the end. Example: torchgemma generate --model gemma3-270m "
        "--max-new-tokens 32 'The capital of France is'",
    )
    generate.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read stdin)")
    generate.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object at the end instead of streaming: text, token_ids, finish_reason "
        "(stop or length), prompt_tokens, new_tokens, timings",
    )
    _add_generation_flags(
        generate,
        quiet="no progress bar, no speed line: stdout and errors only",
        verbose="also say how the model loaded (device, dtype, threads, seconds)",
    )
    _add_media_flags(
        generate,
        "each fills one <|image|> / <|audio|> / <|video|> placeholder of the prompt, in order; a prompt without "
        "placeholders of a kind gets one per file appended at its end",
    )
    generate.set_defaults(func=cmd_generate, parser=generate)

    chat = commands.add_parser(
        "chat",
        help="chat interactively (one user message per stdin line)",
        description="Interactive chat with the checkpoint's chat template: each stdin line is a user "
        "message; the conversation is kept (the oldest turns are dropped, with a note on stderr, when it "
        "outgrows the context). Answers go to stdout, thinking to stderr. Commands: /help, /clear, "
        "/system TEXT, /exit. On a terminal: line editing and history; Ctrl-C stops a reply, and at the "
        "prompt ends the chat. Ends on EOF or /exit.",
    )
    chat.add_argument("--system", default=None, help="a system prompt")
    chat.add_argument("--think", action="store_true", help="let the model think before answering")
    chat.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE",
        help="a Jinja chat template to use instead of the checkpoint's (e.g. for a base model)",
    )
    chat.add_argument(
        "--max-len",
        type=_int_at_least(2),
        default=None,
        metavar="N",
        help="tokens of context for the conversation and its reply (default and most: the model's)",
    )
    chat.add_argument(
        "--allow-control-tokens",
        action="store_true",
        help="let control-token strings typed in messages (<start_of_turn>, <|turn>, ...) act as control "
        "tokens; by default they stay text",
    )
    _add_generation_flags(
        chat,
        quiet="no progress bar, no banner",
        verbose="a speed line after each reply, and how the model loaded",
    )
    _add_media_flags(
        chat,
        "attached to the first user message (before its text) and kept in the conversation",
    )
    chat.set_defaults(func=cmd_chat, parser=chat)

    embed = commands.add_parser(
        "embed",
        help="sentence vectors from a sentence-transformers checkpoint (EmbeddingGemma)",
        description="Sentence embeddings, as sentence-transformers computes them: the checkpoint's "
        "decoder, pooling, dense layers and normalisation, with a task prompt. Prints one JSON line per "
        'text: {"text": ..., "embedding": [...]}. Texts are the arguments, or standard input\'s lines '
        "when there are none.",
    )
    _add_model_flags(embed)
    embed.add_argument("texts", nargs="*", help="the texts (default: one per line of standard input)")
    embed.add_argument(
        "--prompt-name",
        default=None,
        help="a task prompt of the checkpoint (EmbeddingGemma: query, document, ...)",
    )
    embed.add_argument("--prompt", default=None, help="a literal prompt written before each text")
    embed.add_argument(
        "--dimensions", type=_int_at_least(1), default=None, help="keep the first N dimensions (Matryoshka)"
    )
    embed.add_argument("--batch-size", type=_int_at_least(1), default=32)
    embed.set_defaults(func=cmd_embed, parser=embed, quiet=True, verbose=False)
    serve = commands.add_parser(
        "serve",
        help="serve the model over an OpenAI-compatible HTTP API",
        description="An OpenAI-compatible server (chat and text completions, streaming, tools, thinking, "
        "images, audio, transcription, embeddings, /metrics, a chat page at /) with continuous batching. Needs the serve "
        "extra: pip install 'torchgemma[serve]'.",
    )
    _add_model_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    serve.add_argument("--port", type=_int_at_least(0), default=8000)
    serve.add_argument(
        "--max-batch-size", type=_int_at_least(1), default=8, help="requests decoded together (default: 8)"
    )
    serve.add_argument(
        "--max-len",
        type=_int_at_least(2),
        default=4096,
        help="tokens per request, prompt and reply (default: 4096)",
    )
    serve.add_argument(
        "--max-waiting",
        type=_int_at_least(0),
        default=64,
        help="requests queued for a slot before 503s (default: 64)",
    )
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on the API")
    serve.add_argument(
        "--served-model-name", default=None, help="the model id clients use (default: --model)"
    )
    serve.set_defaults(func=cmd_serve, parser=serve, quiet=False, verbose=False)
    debug = commands.add_parser(
        "debug",
        help="numerics debugging (trace: where a run first goes non-finite; compare: two configurations module by module)",
        description="Numerics debugging tools.",
    )
    tools = debug.add_subparsers(dest="tool", required=True)
    trace = tools.add_parser(
        "trace",
        help="per-module statistics of one forward pass, stopping at the first non-finite output",
        description="Run one forward pass over the prompt with a hook on every module: min, max, mean |x|, "
        "NaN/inf counts and the dtype's headroom (its largest value over max |x|) of each output, stopping at "
        "the first module whose output is not finite though its inputs were. --dtype fp16 loads the weights "
        "in float32 and casts the model to float16 (which load refuses for running: this is how to see why).",
    )
    trace.add_argument("prompt", help="the text of the forward pass (raw, no chat template)")
    trace.add_argument("--model", required=True, help="what generate's --model takes")
    trace.add_argument(
        "--dtype", type=_dtype, default="fp32", help="fp32, bf16, fp16 or fp64 (default: fp32)"
    )
    trace.add_argument("--attention", choices=["sdpa", "eager"], default="eager")
    trace.add_argument("--last", type=_int_at_least(1), default=12, help="table rows to show (default: 12)")
    trace.add_argument("--all", action="store_true", help="record every module; do not stop at the failure")
    trace.add_argument("--json", action="store_true", help="print every record as JSON")
    trace.set_defaults(func=cmd_debug_trace, parser=trace, command="debug trace")
    compare = tools.add_parser(
        "compare",
        help="two configurations on the same input, module by module",
        description="Run the prompt through two configurations with a hook on the same module names and "
        "report, for every decoder layer, the max error of each sublayer's output (attention, MLP, experts, "
        "per-layer input, residual) against the second (the baseline), the first module past --threshold, "
        "and the logits' max error, KL divergence and top-1 agreement. A configuration is "
        "IMPL[:OPTION...]: torchgemma, transformers or reference (the float64 NumPy decoder), with a "
        "dtype (fp32, bf16, fp16, fp64), an attention (eager, sdpa) and, for torchgemma, a quantization "
        "(int8, int4, gguf); e.g. torchgemma:bf16:sdpa, transformers:fp32:eager, reference.",
    )
    compare.add_argument("prompt", help="the text of the forward pass (raw, no chat template)")
    compare.add_argument("--model", required=True, help="what generate's --model takes")
    compare.add_argument(
        "--a", default="torchgemma:bf16", help="the configuration measured (default: torchgemma:bf16)"
    )
    compare.add_argument("--b", default="reference", help="the baseline (default: reference)")
    compare.add_argument(
        "--threshold", type=float, default=1e-2, help="relative error that marks a module (default: 0.01)"
    )
    compare.add_argument("--all", action="store_true", help="one row per module instead of per layer")
    compare.add_argument("--json", action="store_true", help="print the whole report as JSON")
    compare.add_argument(
        "--plot", metavar="FILE.png", help="write error by layer, log scale (needs matplotlib)"
    )
    compare.set_defaults(func=cmd_debug_compare, parser=compare, command="debug compare")
    return parser


def cmd_debug_trace(args: argparse.Namespace) -> int:
    import dataclasses

    from .debug import format_trace, trace
    from .tokenizer import load_tokenizer
    from .weights.loading import load

    dtype = resolve_dtype(args.dtype)
    # The float model (quantize=None): the trace is about the dtype's range, not quantized weights.
    model = load(
        args.model,
        dtype=torch.float32 if dtype == torch.float16 else dtype,
        attention=args.attention,
        quantize=None,
    )
    if dtype == torch.float16:
        model = model.to(torch.float16)  # refused by load for running; here to show where it breaks
    tokenizer = load_tokenizer(args.model)
    ids = torch.tensor([tokenizer.encode(args.prompt)])
    report = trace(model, ids, stop=not args.all)
    if args.json:
        rows = [
            {**dataclasses.asdict(r), "dtype": str(r.dtype).removeprefix("torch.")} for r in report.records
        ]
        first = report.first_nonfinite.name if report.first_nonfinite else None
        print(json.dumps({"first_nonfinite": first, "records": rows}))
    else:
        print(format_trace(report, last=args.last))
    return 0


def cmd_debug_compare(args: argparse.Namespace) -> int:
    from .debug import Side, compare, format_compare, plot_compare
    from .tokenizer import load_tokenizer

    sides = [Side.parse(text) for text in (args.a, args.b)]  # bad specs fail before any loading
    if args.plot and not _importable("matplotlib"):
        raise CLIError("--plot needs matplotlib: pip install 'torchgemma[plot]'")
    ids = torch.tensor([load_tokenizer(args.model).encode(args.prompt)])
    report = compare(args.model, ids, *sides, threshold=args.threshold)
    if args.plot:
        plot_compare(report, args.plot)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(format_compare(report, every_module=args.all))
    return 0


# ---- embed ----------------------------------------------------------------------------------------


def cmd_embed(args: argparse.Namespace) -> int:
    texts = args.texts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not texts:
        raise CLIError("no texts: give them as arguments or on standard input, one per line")
    args.image = args.audio = args.video = []
    _prepare(args)
    llm = _load_llm(args)
    if not llm.has_sentence_head:
        raise CLIError(f"{args.model} has no sentence-transformers modules (modules.json): it cannot embed")
    vectors = llm.embed(
        texts,
        prompt_name=args.prompt_name,
        prompt=args.prompt,
        batch_size=args.batch_size,
        truncate_dim=args.dimensions,
    )
    for text, vector in zip(texts, vectors.float().cpu()):
        print(json.dumps({"text": text, "embedding": vector.tolist()}))
    return 0


# ---- serve -----------------------------------------------------------------------------------------


def cmd_serve(args: argparse.Namespace) -> int:
    missing = [
        name for name in ("fastapi", "uvicorn", "prometheus_client", "multipart") if not _importable(name)
    ]
    if missing:
        raise CLIError(f"the server needs {', '.join(missing)}: pip install 'torchgemma[serve]'")
    args.image = args.audio = args.video = []
    _prepare(args)
    import uvicorn

    from .serving.app import create_app

    llm = _load_llm(args)
    name = args.served_model_name or str(args.model)
    app = create_app(
        llm,
        model_name=name,
        max_batch_size=args.max_batch_size,
        max_len=args.max_len,
        max_waiting=args.max_waiting,
        api_key=args.api_key,
    )
    print(
        f"torchgemma serve: {name} at http://{args.host}:{args.port}/v1 "
        f"({args.max_batch_size} slots of {args.max_len} tokens; chat page at http://{args.host}:{args.port}/)",
        flush=True,
    )
    # uvicorn stops cleanly on Ctrl-C and SIGTERM (the app's shutdown stops the engine thread), then
    # re-raises the signal to the handler it found: SIGTERM then ends the process with status 0.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


# ---- errors ----------------------------------------------------------------------------------------


def _one_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return "; ".join(lines) or type(err).__name__


def _describe(err: Exception) -> str | None:
    """The one-line message of an anticipated failure; None for one that is a bug."""
    import jinja2
    from PIL import Image

    if isinstance(err, jinja2.TemplateSyntaxError):
        return f"the chat template has a syntax error at line {err.lineno}: {_one_line(err)}"
    if isinstance(err, jinja2.TemplateError):  # raise_exception() in a template, an undefined name, ...
        return f"the chat template failed: {_one_line(err)}"
    if isinstance(err, Image.DecompressionBombError):
        return f"an image is too large to decode safely: {_one_line(err)}"
    if isinstance(err, torch.OutOfMemoryError):
        return f"out of memory: {_one_line(err)}"
    if isinstance(err, ModuleNotFoundError) and str(err).startswith("No module named"):
        return f"a package is missing: {err} (pip install it, or see the README's optional extras)"
    if isinstance(err, (CLIError, ConfigError, ValueError, OSError, ImportError)):
        return _one_line(err)
    return None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`torchgemma generate ... | head -1`): stop quietly, and let the
        # final flush at exit write nowhere rather than fail again.
        with suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as err:
        message = _describe(err)
        if message is None:
            if getattr(args, "verbose", False):
                import traceback

                traceback.print_exc()
            message = f"{type(err).__name__}: {_one_line(err)} (a bug? --verbose shows the traceback)"
        print(f"torchgemma {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
