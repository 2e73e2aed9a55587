"""``torchgemma chat``: an interactive chat, one user message per stdin line, history kept."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from .common import (
    CLIError,
    check_text,
    default_limit_hint,
    load_llm,
    one_line,
    prepare,
    report_speed,
    sampling_params,
    utf8,
)
from .options import add_generation_flags, add_media_flags, int_at_least
from .precheck import check_chat_template, check_media


def add_parser(commands) -> None:
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
        type=int_at_least(2),
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
    add_generation_flags(
        chat,
        quiet="no progress bar, no banner",
        verbose="a speed line after each reply, and how the model loaded",
    )
    add_media_flags(
        chat,
        "attached to the first user message (before its text) and kept in the conversation",
    )
    chat.set_defaults(func=run, parser=chat)


CHAT_HELP = """\
/help          this list
/clear         forget the conversation (the system prompt stays; --image/--audio/--video files join the next message)
/system TEXT   set the system prompt (/system alone removes it)
/exit          end the chat (or Ctrl-D)
Ctrl-C stops a reply and keeps the conversation; at the prompt it ends the chat.
A message that starts with / : type it as //..."""


def read_template(path: str) -> str:
    file = Path(path).expanduser()
    if not file.is_file():
        raise CLIError(f"chat template file not found: {path!r}")
    return utf8(file.read_bytes(), f"chat template {path!r}")


def run(args: argparse.Namespace) -> int:
    template = read_template(args.chat_template) if args.chat_template else None
    prepare(args)
    check_chat_template(args)
    check_media(args)
    llm = load_llm(args)
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
        self.sampling = sampling_params(args, llm)
        # Control-token strings typed in a message stay text unless the user says otherwise.
        self.rendering = dict(
            enable_thinking=args.think, sanitize_control_tokens=not args.allow_control_tokens
        )
        self.max_len = min(args.max_len or llm.context_length, llm.context_length)
        self.reply_tokens = args.max_new_tokens or llm.generation_config.reply_limit(chat_model=True)
        self.hinted = False  # the default-limit hint, said once per chat
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
                return check_text(input("> "), "the message")
            except EOFError:
                print(file=sys.stderr)
                return None
        if self.interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        if hasattr(sys.stdin, "buffer"):
            data = sys.stdin.buffer.readline()
            line = utf8(data, "stdin") if data else None
        else:
            line = check_text(sys.stdin.readline(), "stdin") or None
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
                    f"torchgemma chat: error: the chat template refuses this system prompt: {one_line(err)}",
                    file=sys.stderr,
                )
                return None
            print("[system prompt set]" if self.system else "[system prompt removed]", file=sys.stderr)
        else:
            print(f"unknown command {name} (/help lists them; //text sends /text)", file=sys.stderr)
        return None

    def reply(self, text: str) -> None:
        from ..generation import GenerationStats

        self.turns.append(self._user_message(text))
        budget = self._fit()
        if budget is None:
            self.turns.pop()
            return
        stats = GenerationStats()
        chunks = self.llm.stream_chat(
            self.messages(), **self.rendering, max_new_tokens=budget, stats=stats, sampling=self.sampling
        )
        answer, in_thought, stop, stopped = [], False, threading.Event(), False
        try:
            with ctrl_c_sets(stop):
                for chunk in chunks:
                    if stop.is_set():
                        stopped = True
                        break
                    # Thinking goes to stderr so that stdout carries the answers alone.
                    if chunk.thinking and not in_thought:
                        print("[thinking] ", end="", file=sys.stderr)
                    elif in_thought and not chunk.thinking:
                        print(file=sys.stderr)
                    in_thought = chunk.thinking
                    print(chunk.text, end="", file=sys.stderr if chunk.thinking else sys.stdout, flush=True)
                    if not chunk.thinking:
                        answer.append(chunk.text)
        except KeyboardInterrupt:  # a second Ctrl-C while the first waits for the next piece
            stopped = True
        if stopped:  # Ctrl-C stops the reply; what came so far stays in the conversation
            chunks.close()
            print("\n[reply stopped]", end="", file=sys.stderr, flush=True)
        if in_thought:
            print(file=sys.stderr)
        print(flush=True)
        self.turns.append({"role": "assistant", "content": "".join(answer)})
        if not self.hinted and stats.steps >= self.reply_tokens:
            default_limit_hint(self.args, self.llm, stats.steps)
            self.hinted = self.args.max_new_tokens is None
        if self.args.verbose:
            report_speed(stats, sys.stderr)

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


@contextmanager
def ctrl_c_sets(stop: threading.Event) -> Iterator[None]:
    """While a reply streams, Ctrl-C sets ``stop`` and the reply ends before its next piece, between
    engine steps; a second Ctrl-C raises KeyboardInterrupt at once. A KeyboardInterrupt raised
    wherever the main thread happens to be could land inside an engine step (leaving the session's
    engine half-updated for the next turn) or inside code that swallows it."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live there only
        yield
        return

    def handler(signum, frame) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
