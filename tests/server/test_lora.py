#!/usr/bin/env python3
"""test_lora.py - `exl serve` with LoRA adapters selected per request.

Usage: test_lora.py EXL_BINARY SHARED_DIR

Starts the server on rand-llama with --lora-modules a1=... a2=... and an admin key. /v1/models lists the base and
both adapters; 18 greedy requests at once (three prompts, twice each, for the base, a1 and a2, so that steps mix
adapters) each get the tokens `exl run --lora DIR` (or no --lora) gives for the prompt; an unknown model is a 404;
the admin endpoints refuse without the key, load a third name (a1 at scale 0.5, equal to `exl run --lora a1:0.5`),
and unload it. Plain http.client: no third-party package. Prints one line per check, then 'N passed, N failed'.
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
MODELS = os.path.join(SHARED, "models")
BASE = os.path.join(MODELS, "rand-llama")
ADAPTERS = {"a1": os.path.join(MODELS, "rand-llama-lora-a1"), "a2": os.path.join(MODELS, "rand-llama-lora-a2")}
PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the park"]
NEW = 12
ADMIN = "let-me-in"


def start():
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), "exl_serve_lora_test.log"), "w+")
    args = [EXL, "serve", "-m", BASE, "--port", "0", "--device", "cpu", "-t", "2", "--quiet", "--admin-key", ADMIN,
            "--lora-modules"] + [f"{k}={v}" for k, v in ADAPTERS.items()]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)
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


def request(port, method, path, body=None, key=None):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if key:
        headers["Authorization"] = "Bearer " + key
    c.request(method, path, json.dumps(body) if body is not None else None, headers)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, json.loads(data)


def run_tokens(lora):
    """the token ids `exl run` gives for each prompt (lora: a --lora argument or None)"""
    args = [EXL, "run", "-m", BASE, "--device", "cpu", "-t", "2", "--greedy", "-n", str(NEW), "--json"]
    for p in PROMPTS:
        args += ["-p", p]
    if lora:
        args += ["--lora", lora]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return [json.loads(line)["tokens"] for line in out.splitlines() if line.strip()]


def complete(port, model, prompt):
    return request(port, "POST", "/v1/completions",
                   {"model": model, "prompt": prompt, "max_tokens": NEW, "temperature": 0})


def main():
    passed = failed = 0

    def check(ok, what):
        nonlocal passed, failed
        print(("ok    " if ok else "FAIL  ") + what)
        passed, failed = passed + bool(ok), failed + (not ok)

    want = {"rand-llama": run_tokens(None), "a1": run_tokens(ADAPTERS["a1"]), "a2": run_tokens(ADAPTERS["a2"])}
    texts = {}
    proc, port = start()
    try:
        status, models = request(port, "GET", "/v1/models")
        ids = [m["id"] for m in models.get("data", [])]
        check(status == 200 and ids == ["rand-llama", "a1", "a2"],
              f"/v1/models lists the base and the adapters: {ids}")
        a1 = [m for m in models.get("data", []) if m["id"] == "a1"]
        check(a1 and a1[0].get("parent") == "rand-llama", "an adapter's parent is the base model")
        jobs = [(model, i) for model in ("rand-llama", "a1", "a2") for i in range(len(PROMPTS))] * 2
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            replies = list(pool.map(lambda j: complete(port, j[0], PROMPTS[j[1]]), jobs))
        check(all(s == 200 for s, _ in replies), f"{len(jobs)} concurrent requests answered 200")
        for (model, i), (status, body) in zip(jobs, replies):
            if status != 200:
                continue
            got = body["choices"][0]["text"]
            texts.setdefault((model, i), got)
            check(body.get("model") == model and texts[(model, i)] == got, f"{model} / prompt {i}: the same text")
        # the server's text against exl run's tokens, through /detokenize
        for (model, i), text in sorted(texts.items()):
            status, d = request(port, "POST", "/detokenize", {"tokens": want[model][i]})
            check(status == 200 and d.get("prompt") == text,
                  f"{model} / prompt {i}: equal to exl run{' --lora' if model != 'rand-llama' else ''}: {text!r}")
        check(len({texts[(m, 0)] for m in ("rand-llama", "a1", "a2")}) == 3, "the three models answer differently")
        status, _ = complete(port, "a3", PROMPTS[0])
        check(status == 404, f"an unknown model is a 404 ({status})")
        body = {"lora_name": "half", "lora_path": ADAPTERS["a1"], "scale": 0.5}
        status, _ = request(port, "POST", "/v1/load_lora_adapter", body)
        check(status == 401, f"loading without the admin key is refused ({status})")
        status, r = request(port, "POST", "/v1/load_lora_adapter", body, key=ADMIN)
        check(status == 200, f"loading with the admin key: {status} {r}")
        half = run_tokens(ADAPTERS["a1"] + ":0.5")[0]
        status, reply = complete(port, "half", PROMPTS[0])
        status2, d = request(port, "POST", "/detokenize", {"tokens": half})
        check(status == 200 and reply["choices"][0]["text"] == d.get("prompt"),
              "an adapter loaded at run time, at scale 0.5, answers as exl run --lora DIR:0.5")
        status, r = request(port, "POST", "/v1/unload_lora_adapter", {"lora_name": "half"}, key=ADMIN)
        deadline = time.time() + 10
        while status == 409 and time.time() < deadline:  # its last job is freed a step after it ends
            complete(port, "rand-llama", PROMPTS[0])
            status, r = request(port, "POST", "/v1/unload_lora_adapter", {"lora_name": "half"}, key=ADMIN)
        check(status == 200, f"unloading: {status} {r}")
        status, _ = complete(port, "half", PROMPTS[0])
        check(status == 404, f"an unloaded adapter is a 404 ({status})")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
