#!/usr/bin/env python3
"""test_speculative.py - `exl serve` with speculative decoding.

Usage: test_speculative.py EXL_BINARY SHARED_DIR

Starts the server on TinyStories with --ngram 3 and its 4-bit GPTQ twin as --draft-model, then: greedy completions
give the same text with drafting and with "speculative": false (the per-request opt-out), seeded sampled ones are
reproducible, concurrent requests (drafting and not, in the same steps) give what they give alone, a non-boolean
"speculative" is a 400 naming the field, and /metrics counts drafted and accepted tokens. Plain http.client: no third-party package.
Prints one line per check, then 'N passed, N failed'.
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
DRAFT_DIR = os.path.join(SHARED, "models", "tinystories-656k-gptq-4bit-g32-actorder-asym")
PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the park", "One day, a bird"]


def start():
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), "exl_serve_spec_test.log"), "w+")
    proc = subprocess.Popen([EXL, "serve", "-m", MODEL_DIR, "--port", "0", "--device", "cpu", "-t", "1",
                             "--cache-tokens", "4096", "--max-jobs", "8", "--quiet", "--ngram", "3",
                             "--draft-model", DRAFT_DIR, "--draft-tokens", "5"],
                            stdout=subprocess.DEVNULL, stderr=log)
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
    raise RuntimeError("exl serve did not start: " + log.read())


def request(port, method, path, body=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    c.request(method, path, json.dumps(body) if body is not None else None,
              {"Content-Type": "application/json"} if body is not None else {})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, (json.loads(data) if path != "/metrics" else data.decode())


def complete(port, prompt, speculative, sampled):
    body = {"prompt": prompt, "max_tokens": 80, "speculative": speculative}
    body.update({"temperature": 0.9, "top_k": 30, "seed": 5} if sampled else {"temperature": 0})
    status, r = request(port, "POST", "/v1/completions", body)
    return r["choices"][0]["text"] if status == 200 else f"status {status}: {r}"


def metric(text, name):
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else -1


def main():
    passed = failed = 0

    def check(ok, what):
        nonlocal passed, failed
        print(("ok    " if ok else "FAIL  ") + what)
        passed, failed = passed + bool(ok), failed + (not ok)

    proc, port = start()
    try:
        for sampled in (False, True):
            what = "seeded sampling" if sampled else "greedy"
            alone = {(p, s): complete(port, p, s, sampled) for p in PROMPTS for s in (True, False)}
            if sampled:  # the draft model's proposals are sampled: the same distribution, other tokens
                check(all(complete(port, p, True, True) == alone[(p, True)] for p in PROMPTS) and
                      all(len(alone[(p, True)]) > 40 for p in PROMPTS), f"{what}: drafted text is reproducible")
            else:
                check(all(alone[(p, True)] == alone[(p, False)] for p in PROMPTS) and
                      all(len(alone[(p, True)]) > 40 for p in PROMPTS),
                      f"{what}: the same text with drafting and with \"speculative\": false")
            with cf.ThreadPoolExecutor(8) as pool:
                jobs = [(p, s) for p in PROMPTS for s in (True, False)]
                together = list(pool.map(lambda a: complete(port, a[0], a[1], sampled), jobs))
            check(together == [alone[a] for a in jobs], f"{what}: 8 concurrent requests, mixed, as alone")
        status, r = request(port, "POST", "/v1/completions", {"prompt": "x", "speculative": 1})
        check(status == 400 and r["error"]["param"] == "speculative", f"a non-boolean \"speculative\": {status} {r}")
        _, text = request(port, "GET", "/metrics")
        drafted, accepted = metric(text, "exl_draft_tokens_total"), metric(text, "exl_draft_accepted_tokens_total")
        check(drafted > 0 and 0 < accepted <= drafted, f"/metrics: {accepted:.0f} of {drafted:.0f} drafts accepted")
    finally:
        proc.send_signal(signal.SIGTERM)
        check(proc.wait(timeout=60) == 0, "clean shutdown")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
