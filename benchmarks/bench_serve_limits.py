"""Hostile requests against a real `torchgemma serve` (Gemma 3 270M): status, time, the server's peak
RSS, /health's worst latency and whether a neighbouring request was unharmed (issue 24's table).

    python benchmarks/bench_serve_limits.py [--src /tmp/before/src] CASE [CASE ...]

``--src`` serves another checkout (e.g. a git worktree of the code before the limits). Each case
starts its own server, so peak RSS is the case's alone. Cases: prompt_100mb, prompt_5mb,
prompt_150kb, image_bombs, audio_no_tower, transcription_no_tower, oversized_body, bad_host,
slow_connections; video_bomb runs ``load_video`` in a subprocess (no server).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

NEIGHBOUR = {"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    def __init__(self, src: str | None, nofile: int | None = None, model: str = "gemma3-270m"):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "2"}
        if src:
            env["PYTHONPATH"] = src
        command = [
            sys.executable,
            "-m",
            "torchgemma.cli",
            "serve",
            "--model",
            model,
            "--port",
            str(self.port),
        ]
        if nofile:
            command = ["prlimit", f"--nofile={nofile}", "--", *command]
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)  # noqa: SIM115 - kept for the tail
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the server did not start: " + Path(self.log.name).read_text()[-2000:])
            time.sleep(0.5)
        self.ps = psutil.Process(self.process.pid)  # (prlimit execs the server: the same pid)
        self.solo = httpx.post(f"{self.url}/v1/completions", json=NEIGHBOUR, timeout=120).json()["choices"][
            0
        ]["text"]

    def rss(self) -> int:
        try:
            return self.ps.memory_info().rss
        except psutil.Error:
            return 0

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


class Watch:
    """While a case runs: the server's peak RSS (every 20 ms), /health's worst latency (every 100 ms),
    and one neighbouring completion started with the case."""

    def __init__(self, server: Server):
        self.server = server
        self.base = server.rss()
        self.peak = self.base
        self.health_worst = 0.0
        self.health_failures = 0
        self.neighbour: str = "?"
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=f) for f in (self._memory, self._health, self._neighbour)]

    def __enter__(self):
        for thread in self._threads:
            thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=300)

    def _memory(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.server.rss())
            time.sleep(0.02)

    def _health(self):
        while not self._stop.is_set():
            start = time.perf_counter()
            try:
                httpx.get(f"{self.server.url}/health", timeout=60)
            except httpx.HTTPError:
                self.health_failures += 1
            self.health_worst = max(self.health_worst, time.perf_counter() - start)
            time.sleep(0.1)

    def _neighbour(self):
        try:
            response = httpx.post(f"{self.server.url}/v1/completions", json=NEIGHBOUR, timeout=300)
            same = response.status_code == 200 and response.json()["choices"][0]["text"] == self.server.solo
            self.neighbour = f"{response.status_code}{' same text' if same else ''}"
        except httpx.HTTPError as error:
            self.neighbour = type(error).__name__

    def row(self, case: str, status: str, seconds: float) -> str:
        gb = 1 << 30
        return (
            f"| {case} | {status} | {seconds:.2f} s | {self.base / gb:.2f} -> {self.peak / gb:.2f} GB "
            f"| /health worst {self.health_worst:.2f} s ({self.health_failures} failed) | neighbour {self.neighbour} "
            f"| server {'up' if self.server.alive() else 'DEAD'} |"
        )


def post(url: str, path: str, **kwargs) -> str:
    try:
        response = httpx.post(f"{url}{path}", timeout=600, **kwargs)
    except httpx.HTTPError as error:
        return type(error).__name__
    try:
        message = response.json().get("error", {}).get("message", "")
    except (json.JSONDecodeError, AttributeError):
        message = response.text[:80]
    return f"{response.status_code} {message[:90]}"


def wav(seconds: float, rate: int = 16_000) -> bytes:
    samples = b"\x01\x00" * int(seconds * rate)
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return (
        b"RIFF" + struct.pack("<I", 36 + len(samples)) + b"WAVEfmt " + struct.pack("<I", 16) + fmt
        + b"data" + struct.pack("<I", len(samples)) + samples
    )  # fmt: skip


def png_bomb() -> str:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (8000, 8000), (10, 20, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def json_body(value) -> dict:
    return {"content": json.dumps(value).encode(), "headers": {"content-type": "application/json"}}


def request_for(case: str) -> tuple[str, dict] | None:
    """The case's path and httpx arguments, built before the case is timed (encoding 100 MB of JSON
    in this process would stall its /health thread and be counted as the server's)."""
    if case == "prompt_100mb":
        return "/v1/completions", json_body({"prompt": "word " * 20_000_000, "max_tokens": 1})
    if case == "prompt_5mb":
        return "/v1/completions", json_body({"prompt": "word " * 1_000_000, "max_tokens": 1})
    if case == "prompt_150kb":
        return "/v1/completions", json_body({"prompt": "word " * 30_000, "max_tokens": 1})
    if case == "image_bombs":  # 16 PNGs of 8000x8000 (~200 KB each; 64 MP, 192 MB as RGB)
        part = {"type": "image_url", "image_url": {"url": png_bomb()}}
        return "/v1/chat/completions", json_body(
            {"messages": [{"role": "user", "content": [part] * 16 + [{"type": "text", "text": "Hi"}]}]}
        )
    if case == "audio_no_tower":  # 150 s of WAV (4.8 MB; 6.4 MB as base64: under the body cap)
        clip = base64.b64encode(wav(150)).decode()
        part = {"type": "input_audio", "input_audio": {"data": clip, "format": "wav"}}
        return "/v1/chat/completions", json_body(
            {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "Hi"}]}]}
        )
    if case == "transcription_no_tower":
        return "/v1/audio/transcriptions", {"files": {"file": ("a.wav", wav(150), "audio/wav")}}
    if case == "oversized_body":
        return "/v1/completions", {
            "content": b"x" * (50 << 20),
            "headers": {"content-type": "application/json"},
        }
    return None


def run_case(case: str, server: Server) -> str:
    url = server.url
    prepared = request_for(case)
    with Watch(server) as watch:
        start = time.perf_counter()
        if prepared is not None:
            path, kwargs = prepared
            status = post(url, path, **kwargs)
        elif case == "bad_host":
            response = httpx.get(f"{url}/v1/models", headers={"Host": "attacker.example.com"})
            status = f"{response.status_code} {response.text[:90]}"
        elif case == "slow_connections":
            idle = []
            for _ in range(1100):
                try:
                    idle.append(socket.create_connection(("127.0.0.1", server.port), timeout=5))
                except OSError:
                    break
            try:
                first = httpx.get(f"{url}/health", timeout=5).status_code
            except httpx.HTTPError as error:
                first = type(error).__name__
            recovered = None
            while time.perf_counter() - start < 90:
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        recovered = time.perf_counter() - start
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.5)
            status = f"{len(idle)} idle connections: /health {first}; " + (
                f"200 again after {recovered:.0f} s" if recovered else "not served again within 90 s"
            )
            for sock in idle:
                sock.close()
        else:
            raise SystemExit(f"unknown case {case}")
        seconds = time.perf_counter() - start
    return watch.row(case, status, seconds)


VIDEO_SCRIPT = """
import sys, time
from torchgemma.processing.video import load_video
start = time.perf_counter()
try:
    video = load_video(sys.argv[1])
    outcome = f"decoded {tuple(video.frames.shape)}"
except ValueError as error:
    outcome = f"ValueError: {error}"[:160]
# VmHWM, not ru_maxrss: the latter keeps the parent's peak across fork and exec.
peak = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) / (1 << 20)
print(f"| video_bomb | {outcome} | {time.perf_counter() - start:.2f} s | peak {peak:.2f} GB |")
"""


def video_bomb(src: str | None) -> str:
    import av
    import numpy as np

    path = Path(tempfile.gettempdir()) / "bench-video-bomb.mp4"
    if not path.exists():
        with av.open(str(path), "w") as container:
            stream = container.add_stream("libx264", rate=10)
            stream.width, stream.height, stream.pix_fmt = 7680, 4320, "yuv420p"
            black = np.zeros((4320, 7680, 3), dtype=np.uint8)
            for _ in range(40):
                container.mux(stream.encode(av.VideoFrame.from_ndarray(black, format="rgb24")))
            container.mux(stream.encode())
    env = {**os.environ, **({"PYTHONPATH": src} if src else {})}
    out = subprocess.run(
        [sys.executable, "-c", VIDEO_SCRIPT, str(path)], env=env, capture_output=True, text=True
    )
    return f"({path.stat().st_size / 1e3:.0f} KB file) " + (out.stdout.strip() or out.stderr[-500:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--src", default=None, help="PYTHONPATH for the server (another checkout's src)")
    parser.add_argument(
        "--model", default="gemma3-270m", help="what to serve (image_bombs: one with a vision tower)"
    )
    parser.add_argument("cases", nargs="+")
    args = parser.parse_args()
    for case in args.cases:
        if case == "video_bomb":
            print(video_bomb(args.src), flush=True)
            continue
        server = Server(args.src, nofile=1024 if case == "slow_connections" else None, model=args.model)
        try:
            print(run_case(case, server), flush=True)
        finally:
            server.stop()
            tail = Path(server.log.name).read_text()[-300:]
            if not server.alive() and "Traceback" in tail:
                print("   server log tail:", tail.replace("\n", " | "), flush=True)


if __name__ == "__main__":
    main()
