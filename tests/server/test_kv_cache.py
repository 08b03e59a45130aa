#!/usr/bin/env python3
"""test_kv_cache.py - `exl serve` with a small quantized KV cache under load.

Usage: test_kv_cache.py EXL_BINARY SHARED_DIR

Starts the server with --cache-tokens 1024 --cache-bits 4 --max-jobs 32 (the TinyStories model, 512-token
context), then 32 clients at once each ask for a 100-token completion (end of sequence banned): every request
must complete with its 100 tokens, none refused, while the cache holds about a third of what they need together
(jobs wait for pages or are preempted). Checks the pool size printed at start and that /health shows every page
released at the end. Plain http.client: no third-party package. Prints one line per check, then 'N passed, N failed'.
"""
import concurrent.futures as cf
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time

EXL, SHARED = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
MODEL_DIR = os.path.join(SHARED, "models", "tinystories-656k")
PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the park", "One day, a bird",
           "Lily liked to", "The sun was", "A big red ball", "Max and his mom"]
CLIENTS, NEW_TOKENS = 32, 100


def start():
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), "exl_serve_kv_test.log"), "w+")
    proc = subprocess.Popen([EXL, "serve", "-m", MODEL_DIR, "--port", "0", "--device", "cpu", "-t", "1",
                             "--cache-tokens", "1024", "--cache-bits", "4", "--max-jobs", str(CLIENTS), "--quiet"],
                            stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 60
    while time.time() < deadline:
        log.seek(0)
        text = log.read()
        m = re.search(r"http://[^:]+:(\d+)/v1", text)
        if m:
            return proc, int(m.group(1)), text
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    log.seek(0)
    raise RuntimeError("exl serve did not start: " + log.read())


def request(port, method, path, body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request(method, path, json.dumps(body) if body is not None else None,
              {"Content-Type": "application/json"} if body is not None else {})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, json.loads(data)


def complete(port, i):
    return request(port, "POST", "/v1/completions",
                   {"model": "tinystories-656k", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": NEW_TOKENS,
                    "seed": i, "logit_bias": {"2": -100}})


def main():
    passed = failed = 0

    def check(ok, what):
        nonlocal passed, failed
        print(("ok    " if ok else "FAIL  ") + what)
        passed, failed = passed + bool(ok), failed + (not ok)

    proc, port, log = start()
    try:
        check("kv cache of 1024 tokens (64 pages of 16), keys 4-bit, values 4-bit" in log,
              "the pool printed at start: " + log.splitlines()[0])
        t0 = time.time()
        with cf.ThreadPoolExecutor(CLIENTS) as pool:
            replies = list(pool.map(lambda i: complete(port, i), range(CLIENTS)))
        statuses = [s for s, _ in replies]
        check(statuses == [200] * CLIENTS, f"{CLIENTS} concurrent requests answered 200: {statuses}")
        done = [r["usage"]["completion_tokens"] == NEW_TOKENS and r["choices"][0]["finish_reason"] == "length"
                for s, r in replies if s == 200]
        check(len(done) == CLIENTS and all(done),
              f"each completed its {NEW_TOKENS} tokens ({sum(done)} of {CLIENTS}, {time.time() - t0:.1f} s)")
        status, health = request(port, "GET", "/health")
        check(status == 200 and health["pages_total"] == 64 and health["pages_used"] == 0 and
              health["jobs_finished"] >= CLIENTS, f"every page released afterwards: {health}")
    finally:
        proc.send_signal(signal.SIGTERM)
        check(proc.wait(timeout=60) == 0, "clean shutdown")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
