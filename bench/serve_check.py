"""A second opinion on `pdserve bench`'s throughput, from a client that shares none of its code:
`curl` processes in a closed loop (one per client; C's HTTP and SSE handling, started fresh
for every request), or, on a machine without curl, Python's standard http.client on one thread
per client. Same prompts (token ids), output lengths and concurrency as the workload.

TTFT here is curl's time to the first byte: the router answers once the first token is ready
(its errors before output become an HTTP status), so the first body byte is the first token.
Output tokens are the usage that the stream's last chunk reports.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
import urllib.parse

from pdserve.bench.serve_compare import Workload, prompts


def _usage(lines: list[str]) -> int:
    for line in reversed(lines):
        if line.startswith("data: {") and '"usage"' in line:
            return int(json.loads(line[6:])["usage"]["completion_tokens"])
    return 0


def _curl_one(url: str, body_file: str, out_file: str) -> tuple[float, int]:
    proc = subprocess.run(
        ["curl", "-sS", "-N", "-o", out_file, "-w", "%{time_starttransfer} %{http_code}",
         "-H", "Content-Type: application/json", "--data-binary", f"@{body_file}",
         f"{url}/v1/completions"], capture_output=True, text=True, check=False, timeout=900)
    ttfb, code = proc.stdout.split() if proc.returncode == 0 else ("0", "0")
    with open(out_file, encoding="utf-8", errors="replace") as f:
        tokens = _usage(f.read().splitlines()) if code == "200" else 0
    return float(ttfb), tokens


def _stdlib_one(url: str, body_file: str, out_file: str) -> tuple[float, int]:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=900)
    with open(body_file, "rb") as f:
        body = f.read()
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    first, lines = 0.0, []
    while raw := resp.fp.readline():
        if not first:
            first = time.perf_counter() - t0
        lines.append(raw.decode("utf-8", "replace").rstrip("\n"))
    conn.close()
    return first, _usage(lines) if resp.status == 200 else 0


def independent_check(url: str, w: Workload, seed: int, out_dir: str) -> dict:
    """The workload run by the other client. Its request bodies and streams live in a
    temporary folder (hundreds of files would crowd out `out_dir`'s results on the GPU
    machine, whose returned files are capped); the first stream is kept in `out_dir`."""
    with tempfile.TemporaryDirectory(prefix=f"check-{w.name}-") as work:
        out = _check_in(url, w, seed, work)
        first = os.path.join(work, "out-0.txt")
        if os.path.exists(first):
            shutil.copyfile(first, os.path.join(out_dir, f"check-{w.name}-stream-0.txt"))
    return out


def _check_in(url: str, w: Workload, seed: int, work: str) -> dict:
    files = []
    for i, ids in enumerate(prompts(w, seed)):
        body = {"prompt": ids, "max_tokens": w.output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        path = os.path.join(work, f"body-{i}.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(body, f)
        files.append((path, os.path.join(work, f"out-{i}.txt")))
    curl = shutil.which("curl")
    one = _curl_one if curl else _stdlib_one
    client = "curl" if curl else "python http.client"
    if curl:
        version = subprocess.run([curl, "--version"], capture_output=True, text=True).stdout
        client = " ".join(version.split()[:2])
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(w.clients) as pool:
        results = list(pool.map(lambda f: one(url, *f), files))
    wall = time.perf_counter() - t0
    ok = [(t, n) for t, n in results if n > 0]
    return {"client": client, "requests": len(files), "completed": len(ok),
            "output_tok_s": sum(n for _, n in ok) / wall,
            "ttft_p50_ms": statistics.median(t for t, _ in ok) * 1e3 if ok else 0.0,
            "duration_s": wall}
