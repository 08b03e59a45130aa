#!/usr/bin/env python3
"""server_load.py - load generator for `exl serve`: requests/s, time to first token and
inter-token latency (p50/p99) at several numbers of concurrent streaming clients.

Each client is an asyncio task that sends streaming /v1/completions requests one after
another over raw HTTP/1.0 (no client library in the measurement) and times the SSE
chunks: TTFT = request sent -> first chunk with text; ITL = gaps between later text
chunks. Requests ask for ignore_eos, so every one makes max_tokens tokens. "TTFT p50 in ITLs": TTFT p50 / ITL p50,
the time to first token in steps of the generator (ITL p50 is its step at that load), steadier than milliseconds on
a shared machine. EXL_STEP_TRACE=FILE in the environment reaches the server this starts (bench/step_trace.py).
Sampling: temperature 0.8 by default; --top-p / --top-k add those filters, --temperature 0 is greedy.

  python3 bench/server_load.py --exl build/exl -m ../shared/models/tinystories-656k
  python3 bench/server_load.py --url http://127.0.0.1:8000   # a server already running
  python3 bench/server_load.py --exl build/exl -m MODEL --top-p 0.95 --concurrency 1,16,32,64
"""
import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time

PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the park", "One day, a bird"]


def cpu_seconds(pid):
    """user + system CPU seconds of a process so far (Linux), or None"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


async def one_request(host, port, key, prompt, max_tokens, sampling):
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                       **sampling}).encode()
    head = (f"POST /v1/completions HTTP/1.0\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n" + (f"Authorization: Bearer {key}\r\n" if key else "") + "\r\n")
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(head.encode() + body)
    await writer.drain()
    status = (await reader.readline()).split()[1]
    if status != b"200":
        raise RuntimeError(f"HTTP {status.decode()}: {(await reader.read()).decode()[:300]}")
    while (await reader.readline()) not in (b"\r\n", b""):
        pass
    times, n_chunks = [], 0
    async for line in reader:
        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
            continue
        chunk = json.loads(line[6:])
        if chunk["choices"] and chunk["choices"][0]["text"]:
            times.append(time.perf_counter())
            n_chunks += 1
    writer.close()
    return t0, times


async def level(host, port, key, clients, per_client, max_tokens, sampling):
    ttft, itl, done = [], [], 0

    async def client(i):
        nonlocal done
        for k in range(per_client):
            t0, times = await one_request(host, port, key, PROMPTS[(i + k) % len(PROMPTS)], max_tokens, sampling)
            ttft.append(times[0] - t0)
            itl.extend(b - a for a, b in zip(times, times[1:]))
            done += 1

    t = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    wall = time.perf_counter() - t
    return {"clients": clients, "requests": done, "wall_s": wall, "req_per_s": done / wall,
            "tok_per_s": done * max_tokens / wall,
            "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p99_ms": pct(ttft, 99) * 1e3,
            "itl_p50_ms": pct(itl, 50) * 1e3, "itl_p99_ms": pct(itl, 99) * 1e3}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exl", help="exl binary: start `exl serve` for the run")
    ap.add_argument("-m", "--model", help="model directory (with --exl)")
    ap.add_argument("--serve-args", default="", help="more `exl serve` options, e.g. '--max-jobs 32 -t 2'")
    ap.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--concurrency", default="1,16,32,64")
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    ap.add_argument("--top-p", type=float, default=None, help="e.g. 0.95 (default: off)")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--json", action="store_true", help="one JSON object per level instead of the table")
    a = ap.parse_args()
    sampling = {"temperature": a.temperature}
    if a.top_p is not None:
        sampling["top_p"] = a.top_p
    if a.top_k is not None:
        sampling["top_k"] = a.top_k
    proc = None
    if a.url:
        m = re.match(r"https?://([^:/]+):(\d+)", a.url)
        host, port = m.group(1), int(m.group(2))
    else:
        proc = subprocess.Popen([a.exl, "serve", "-m", a.model, "--port", "0", "--quiet", *a.serve_args.split()],
                                stderr=subprocess.PIPE, text=True)
        seen = ""
        while not (m := re.search(r"http://([^:]+):(\d+)", seen)):  # the address follows the cache's line
            line = proc.stderr.readline()
            if not line:
                sys.exit(f"exl serve did not start: {seen}")
            seen += line
        host, port = m.group(1), int(m.group(2))
    try:
        if not a.json:
            print("| clients | requests | req/s | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms |"
                  " TTFT p50 in ITLs | server CPU ms/token |")
            print("|---|---|---|---|---|---|---|---|---|---|")
        for c in [int(x) for x in a.concurrency.split(",")]:
            cpu0 = cpu_seconds(proc.pid) if proc else None
            r = asyncio.run(level(host, port, a.api_key, c, a.requests_per_client, a.max_tokens, sampling))
            cpu1 = cpu_seconds(proc.pid) if proc else None
            # the server's own CPU time for the level (only when this script started it): unlike the rates, it
            # does not depend on what else the machine runs
            r["server_cpu_s"] = cpu1 - cpu0 if cpu0 is not None and cpu1 is not None else None
            r["server_cpu_ms_per_token"] = (r["server_cpu_s"] * 1e3 / (r["requests"] * a.max_tokens)
                                            if r["server_cpu_s"] is not None else None)
            if a.json:
                print(json.dumps(r), flush=True)
                continue
            print(f"| {r['clients']} | {r['requests']} | {r['req_per_s']:.2f} | {r['tok_per_s']:.0f} | "
                  f"{r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['itl_p50_ms']:.2f} | {r['itl_p99_ms']:.2f} | "
                  f"{r['ttft_p50_ms'] / r['itl_p50_ms']:.1f} | "
                  + (f"{r['server_cpu_ms_per_token']:.3f} |" if r["server_cpu_ms_per_token"] is not None else "- |"),
                  flush=True)
    finally:
        if proc:
            proc.terminate()
            proc.wait()


if __name__ == "__main__":
    main()
