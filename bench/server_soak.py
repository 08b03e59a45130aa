#!/usr/bin/env python3
"""server_soak.py - a soak test of `exl serve`: well-behaved streaming clients, idle connections and
clients that leave at random, together for N minutes.

    bench/server_soak.py --exl build/exl --model ../shared/models/tinystories-656k --minutes 10

Starts the server (niced, on a free loopback port), then runs at once:
  --streams (64) clients in a loop: a streamed completion or chat of 16..128 tokens each, checked to
      the end (HTTP 200, every event JSON, a finish_reason per choice, [DONE], the chunked end);
  --idle (200) connections that send nothing, reopened whenever the server closes them;
  --leavers (8) clients in a loop: a request (streamed or not), then a hang-up after 0..1 s, half of
      them with a reset (SO_LINGER 0).
Every --every (10) seconds it samples the server's VmRSS and /metrics. At the end: the server must come
back to no jobs and no pages held, and exit 0 on SIGTERM. Prints the summary (errors of the well-behaved
clients, time to first token p50/p90/p99, tokens generated per second, the RSS curve) and writes it as JSON (--json).
Python's standard library only. Exit status 1 when a well-behaved client saw an error.
"""
import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the park", "One day, a bird",
           "Lily had a red ball", "The sun was hot and"]


class Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.ok = self.errors = self.left = self.reopened = 0
        self.ttft = []
        self.error_samples = []

    def add(self, **kw):
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def error(self, what):
        with self.lock:
            self.errors += 1
            if len(self.error_samples) < 20:
                self.error_samples.append(what[:300])


def start_server(args):
    log = open(args.log, "w+")
    cmd = ["nice", "-n", str(args.nice), args.exl, "serve", "-m", args.model, "--port", "0", "-t", str(args.threads),
           "--max-jobs", str(args.max_jobs), "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 60
    while time.time() < deadline:
        log.seek(0)
        m = re.search(r"http://[^:]+:(\d+)/v1", log.read())
        if m:
            return proc, int(m.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    log.seek(0)
    raise SystemExit("exl serve did not start: " + log.read())


def stream_once(port, rng, stats):
    chat = rng.random() < 0.5
    n_tokens = rng.randint(16, 128)
    prompt = rng.choice(PROMPTS)
    body = {"max_tokens": n_tokens, "stream": True, "temperature": 0.8, "seed": rng.randint(0, 1 << 30)}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t0 = time.time()
    try:
        c.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
        r = c.getresponse()
        if r.status != 200:
            stats.error(f"HTTP {r.status}: {r.read()[:200]!r}")
            return
        first = None
        finish = done = False
        while True:
            line = r.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                stats.error(f"error event: {event}")
                return
            ch = event["choices"][0]
            text = ch.get("text") if not chat else (ch.get("delta") or {}).get("content")
            if text and first is None:
                first = time.time() - t0
            finish = finish or ch.get("finish_reason") in ("stop", "length")
        r.close()
        if not (done and finish and first is not None):
            stats.error(f"incomplete stream: done={done} finish={finish} first={first}")
            return
        with stats.lock:
            stats.ok += 1
            stats.ttft.append(first)
    except (OSError, http.client.HTTPException, ValueError, KeyError, IndexError) as e:
        stats.error(f"{type(e).__name__}: {e}")
    finally:
        c.close()


def leave_once(port, rng, stats):
    stream = rng.random() < 0.5
    body = json.dumps({"prompt": rng.choice(PROMPTS), "max_tokens": 256, "stream": stream}).encode()
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        time.sleep(rng.random())
        if rng.random() < 0.5:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset
        s.close()
        stats.add(left=1)
    except OSError:
        pass  # a leaver's troubles are its own


def idle_keeper(port, n, stop, stats):
    socks = [None] * n
    while not stop.is_set():
        for i in range(n):
            s = socks[i]
            if s is not None:
                s.setblocking(False)
                try:
                    if s.recv(1) == b"":
                        s.close()
                        s = None
                except BlockingIOError:
                    pass
                except OSError:
                    s.close()
                    s = None
            if s is None:
                try:
                    socks[i] = socket.create_connection(("127.0.0.1", port), timeout=5)
                    stats.add(reopened=1)
                except OSError:
                    socks[i] = None
            else:
                socks[i] = s
        stop.wait(2.0)
    for s in socks:
        if s:
            s.close()


def metrics(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(exl_[a-z_]+) ([0-9.e+-]+)$", text, re.M)}


def rss_kb(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def percentile(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))] if xs else float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--exl", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--minutes", type=float, default=10)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--idle", type=int, default=200)
    ap.add_argument("--leavers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="the server's CPU threads (-t)")
    ap.add_argument("--max-jobs", type=int, default=64)
    ap.add_argument("--nice", type=int, default=10)
    ap.add_argument("--every", type=float, default=10, help="seconds between samples")
    ap.add_argument("--log", default="/tmp/exl_soak_server.log")
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args()

    proc, port = start_server(args)
    stats, stop = Stats(), threading.Event()
    rss0 = rss_kb(proc.pid)
    generated0 = metrics(port)["exl_generated_tokens_total"]
    end = time.time() + args.minutes * 60

    def loop(fn, seed):
        rng = random.Random(seed)
        while time.time() < end:
            fn(port, rng, stats)

    threads = [threading.Thread(target=loop, args=(stream_once, i)) for i in range(args.streams)]
    threads += [threading.Thread(target=loop, args=(leave_once, 1000 + i)) for i in range(args.leavers)]
    keeper = threading.Thread(target=idle_keeper, args=(port, args.idle, stop, stats))
    keeper.start()
    t_start = time.time()
    for t in threads:
        t.start()
    samples = []
    while any(t.is_alive() for t in threads):
        time.sleep(min(args.every, max(0.1, end - time.time() + 0.5)))
        m = metrics(port)
        s = {"t": round(time.time() - t_start), "rss_kb": rss_kb(proc.pid), "ok": stats.ok, "errors": stats.errors,
             "running": m.get("exl_jobs_running"), "waiting": m.get("exl_jobs_waiting"),
             "pages_used": m.get("exl_kv_pages_used")}
        samples.append(s)
        print(json.dumps(s), flush=True)
    for t in threads:
        t.join()
    elapsed = time.time() - t_start
    stop.set()
    keeper.join()
    # every job gone and every page released once the clients are
    settled = None
    for _ in range(100):
        m = metrics(port)
        if m.get("exl_jobs_running") == 0 and m.get("exl_jobs_waiting") == 0 and m.get("exl_kv_pages_used") == 0:
            settled = m
            break
        time.sleep(0.1)
    rss_end = rss_kb(proc.pid)
    generated = metrics(port)["exl_generated_tokens_total"] - generated0
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=60)
    summary = {
        "minutes": round(elapsed / 60, 2), "streams": args.streams, "idle": args.idle, "leavers": args.leavers,
        "requests_ok": stats.ok, "errors": stats.errors, "error_samples": stats.error_samples,
        "left": stats.left, "idle_reopened": stats.reopened, "generated_tokens_per_s": round(generated / elapsed, 1),
        "ttft_ms": {p: round(percentile(stats.ttft, p) * 1e3, 1) for p in (50, 90, 99)},
        "ttft_max_ms": round(max(stats.ttft) * 1e3, 1) if stats.ttft else None,
        "rss_kb": {"start": rss0, "end": rss_end, "max": max(s["rss_kb"] for s in samples)},
        "rss_curve_kb": [(s["t"], s["rss_kb"]) for s in samples],
        "settled": settled is not None, "exit_status": rc,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if stats.errors == 0 and settled is not None and rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
