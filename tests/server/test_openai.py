#!/usr/bin/env python3
"""test_openai.py - `exl serve` end to end, driven by the official `openai` package.

Usage: test_openai.py EXL_BINARY SHARED_DIR

Starts the server on a free loopback port with the TinyStories model and an API key,
then checks: completions and chat, plain and streamed, against `exl run --greedy`; the
sampling defaults and token counts against `exl run`;
prompt lists, n, seeds, stop strings, logprobs, logit_bias; every error case with its
status and OpenAI-shaped error object (raw HTTP for the malformed ones); clients that
leave early have their jobs cancelled and pages released; 32 concurrent streaming
clients; flat memory (VmRSS) over repeated rounds; a clean exit on SIGTERM.
Prints one line per test and closes with 'N passed, N failed'.
"""
import concurrent.futures as cf
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import openai

EXL, SHARED = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
MODEL_DIR = os.path.join(SHARED, "models", "tinystories-656k")
MODEL = "tinystories-656k"
KEY = "sk-test-key"
PROMPTS = ["Once upon a time", "The little dog", "Tom and Sue went to the park", "One day, a bird"]
TESTS = []


def test(fn):
    TESTS.append(fn)
    return fn


# ---------------------------------------------------------------- server and helpers

class Server:
    def __init__(self, *extra):
        self.log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), "exl_serve_test.log"), "w+")
        self.proc = subprocess.Popen([EXL, "serve", "-m", MODEL_DIR, "--port", "0", "--api-key", KEY,
                                      "--max-body", "65536", "-t", "1", *extra],
                                     stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.time() + 60
        while time.time() < deadline:
            self.log.seek(0)
            m = re.search(r"http://[^:]+:(\d+)/v1", self.log.read())
            if m:
                self.port = int(m.group(1))
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.log.seek(0)
        raise RuntimeError("exl serve did not start: " + self.log.read())

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)

    def rss_kb(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def client():
    return openai.OpenAI(base_url=f"http://127.0.0.1:{SRV.port}/v1", api_key=KEY, max_retries=0, timeout=120)


def raw(method, path, body=None, headers=None, auth=True):
    """One request over http.client: (status, parsed JSON or text, headers)."""
    c = http.client.HTTPConnection("127.0.0.1", SRV.port, timeout=120)
    h = {"Authorization": f"Bearer {KEY}"} if auth else {}
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()
    if body is not None:
        h["Content-Type"] = "application/json"
    h.update(headers or {})
    c.request(method, path, body=body, headers=h)
    r = c.getresponse()
    data = r.read()
    c.close()
    try:
        return r.status, json.loads(data), dict(r.getheaders())
    except ValueError:
        return r.status, data.decode(errors="replace"), dict(r.getheaders())


def check_error(status, body, want_status, param=None):
    assert status == want_status, (status, body)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    e = body["error"]
    assert set(e) == {"message", "type", "param", "code"}, e
    assert isinstance(e["message"], str) and e["message"], e
    if param is not None:
        assert e["param"] == param, e


_REF = {}


def reference(prompt, n, *sampling):
    """What `exl run` makes of the prompt: greedy unless sampling options are given."""
    key = (prompt, n, sampling)
    if key not in _REF:
        out = subprocess.run([EXL, "run", "-m", MODEL_DIR, "-p", prompt, "-n", str(n), "--json", "-t", "1",
                              *(sampling or ["--greedy"])], check=True, capture_output=True, text=True).stdout
        _REF[key] = json.loads(out.strip().splitlines()[-1])
    return _REF[key]


def health():
    s, body, _ = raw("GET", "/health", auth=False)
    assert s == 200, (s, body)
    return body


def wait_idle(timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        h = health()
        if h["jobs_running"] == 0 and h["jobs_waiting"] == 0 and h["pages_used"] == 0:
            return h
        time.sleep(0.1)
    raise AssertionError(f"jobs still held after {timeout}s: {health()}")


# ---------------------------------------------------------------- completions and chat

@test
def models_and_health():
    ids = [m.id for m in client().models.list().data]
    assert ids == [MODEL], ids
    assert client().models.retrieve(MODEL).id == MODEL
    h = health()
    assert h["status"] == "ok" and h["model"] == MODEL, h


@test
def completion_greedy_matches_exl_run():
    for p in PROMPTS[:3]:
        r = client().completions.create(model=MODEL, prompt=p, max_tokens=40, temperature=0)
        ref = reference(p, 40)
        assert r.choices[0].text == ref["text"], (r.choices[0].text, ref["text"])
        assert r.choices[0].finish_reason == ref["finish_reason"] == "length"
        assert r.usage.completion_tokens == len(ref["tokens"]) and r.usage.prompt_tokens > 0
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == MODEL


@test
def defaults_and_counts_match_exl_run():
    """One set of sampling defaults (exl_sampling_default) and one counting rule: a request that sets
    nothing but the seed samples as `exl run --seed` does, and a completion that ends on the
    end-of-sequence token counts it in usage.completion_tokens as exl run lists it in its tokens."""
    r = client().completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=32, seed=7)
    ref = reference(PROMPTS[1], 32, "--seed", "7")
    assert r.choices[0].text == ref["text"], (r.choices[0].text, ref["text"])
    r = client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=300, temperature=0)
    ref = reference(PROMPTS[0], 300)
    assert ref["finish_reason"] == r.choices[0].finish_reason == "stop" and ref["tokens"][-1] == 2, ref
    assert r.choices[0].text == ref["text"] and r.usage.completion_tokens == len(ref["tokens"]), r.usage


@test
def completion_stream_matches():
    chunks = list(client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                              stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == reference(PROMPTS[0], 40)["text"], text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


@test
def completion_prompt_list_and_token_prompt():
    r = client().completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=24, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        assert c.text == reference(PROMPTS[c.index], 24)["text"], c
    ids = subprocess.run([EXL, "tokenize", "-m", MODEL_DIR, "--special"], input=PROMPTS[1], capture_output=True,
                         text=True, check=True).stdout.split()
    ids = [int(t) for t in ids]
    r2 = client().completions.create(model=MODEL, prompt=ids, max_tokens=24, temperature=0)
    assert r2.choices[0].text == reference(PROMPTS[1], 24)["text"], (ids, r2.choices[0].text)


@test
def chat_plain_and_stream():
    msgs = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "Tell me about a cat."}]
    r = client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=30, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    text = r.choices[0].message.content
    assert text and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0 and r.usage.prompt_tokens > 10
    chunks = list(client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=30, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == r.usage.total_tokens
    assert chunks[-2].choices[0].finish_reason == r.choices[0].finish_reason
    # max_completion_tokens and content parts
    r = client().chat.completions.create(model=MODEL, max_completion_tokens=5, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Tell me about a cat."}]}])
    assert r.usage.completion_tokens <= 5


@test
def seeds_n_and_sampling():
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=1.0, top_p=0.9, seed=1234, n=3,
              extra_body={"top_k": 50, "min_p": 0.01, "repetition_penalty": 1.1})
    a = client().completions.create(**kw)
    b = client().completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1, "the n choices of one seed should differ"
    r = client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, presence_penalty=1.5,
                                    frequency_penalty=1.0, extra_body={"typical_p": 0.9}, user="me")
    assert r.choices[0].text
    # ignore_eos (as vLLM's): a greedy completion that would end early goes on to max_tokens
    short = client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=400, temperature=0)
    if short.choices[0].finish_reason == "stop":
        r = client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=400, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 400, r.usage


@test
def stop_strings():
    ref = reference(PROMPTS[0], 40)["text"]
    stop = "Lily"
    assert stop in ref
    r = client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].text == ref[:ref.index(stop)] and r.choices[0].finish_reason == "stop", r.choices[0]
    chunks = list(client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=40, temperature=0,
                                              stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref[:ref.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


@test
def logprobs():
    r = client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert "".join(lp.tokens) == r.choices[0].text
    for t, l, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert l <= 0 and len(top) <= 3 and abs(max(top.values()) - l) < 1e-4  # greedy: the best one
    r = client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                         temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert content and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert bytes(b for c in content for b in c.bytes).decode() == r.choices[0].message.content
    chunks = list(client().completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0,
                                              logprobs=1, stream=True))
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs) == 10


@test
def logit_bias():
    kw = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=0)
    plain = client().completions.create(**kw).choices[0]
    assert plain.text == reference(PROMPTS[0], 8)["text"]
    first = reference(PROMPTS[0], 8)["tokens"][0]
    banned = client().completions.create(**kw, logit_bias={str(first): -100}).choices[0]
    assert banned.logprobs.tokens[0] != plain.logprobs.tokens[0], (plain, banned)
    forced = client().completions.create(**kw, logit_bias={"500": 100}).choices[0]
    assert len(set(forced.logprobs.tokens)) == 1, forced


# ---------------------------------------------------------------- errors

@test
def error_statuses():
    ok = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    cases = [  # (body changes, param at fault)
        ({"temperature": "hot"}, "temperature"), ({"temperature": 2.5}, "temperature"), ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"), ({"n": 1.5}, "n"), ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": "9"}, "max_tokens"),
        ({"stop": 5}, "stop"), ({"stop": ["a", 1]}, "stop"), ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"), ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"seed": "x"}, "seed"), ({"stream": "yes"}, "stream"), ({"logprobs": 21}, "logprobs"),
        ({"prompt": 5}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": [1, 99999]}, "prompt"),
        ({"prompt": None}, "prompt"), ({"top_k": -2}, "top_k"), ({"min_p": 2}, "min_p"),
        ({"typical_p": 0}, "typical_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stream_options": 3}, "stream_options"), ({"echo": True}, "echo"), ({"user": 5}, "user"),
        ({"model": 7}, "model"),
    ]
    for change, param in cases:
        body = dict(ok, **change)
        if change.get("prompt", 0) is None:
            del body["prompt"]
        s, b, _ = raw("POST", "/v1/completions", body)
        check_error(s, b, 400, param)
    chat_cases = [({"messages": "hi"}, "messages"), ({"messages": []}, "messages"),
                  ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
                  ({"messages": [{"role": "user", "content": 5}]}, "messages"),
                  ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
                  ({"top_logprobs": 2}, "top_logprobs"), ({"logprobs": 1}, "logprobs"), ({"tools": [{}]}, "tools")]
    for change, param in chat_cases:
        body = dict({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}, **change)
        s, b, _ = raw("POST", "/v1/chat/completions", body)
        check_error(s, b, 400, param)


@test
def error_malformed_bodies():
    for body in [b"{", b"not json", b'{"prompt": "a"} trailing', b"", b"[1, 2]", b'"str"', b"\xff\xfe{}",
                 b'{"prompt": "\xc3\x28"}', b'{"prompt": "\xed\xa0\x80"}', b'{"prompt": "\xc0\xaf"}',
                 b"{" * 5000 + b"}" * 5000, bytes(range(256))]:
        s, b, _ = raw("POST", "/v1/completions", body)
        check_error(s, b, 400)
    s, b, _ = raw("POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xf4\x90\x80\x80"}]}')
    check_error(s, b, 400)
    assert health()["status"] == "ok"


@test
def error_model_route_method_size_context():
    c = client()
    try:
        c.completions.create(model="gpt-9", prompt="Hi", max_tokens=2)
        raise AssertionError("unknown model accepted")
    except openai.NotFoundError as e:
        assert e.status_code == 404 and e.body["code"] == "model_not_found" and e.body["param"] == "model"
    s, b, _ = raw("GET", "/v1/models/gpt-9")
    check_error(s, b, 404)
    s, b, _ = raw("POST", "/v1/nothing", {"x": 1})
    check_error(s, b, 404)
    s, b, _ = raw("GET", "/nothing")
    check_error(s, b, 404)
    s, b, h = raw("GET", "/v1/chat/completions")
    check_error(s, b, 405)
    assert h.get("Allow") == "POST", h
    s, b, _ = raw("DELETE", "/v1/models")
    check_error(s, b, 405)
    s, b, _ = raw("POST", "/v1/completions", {"model": MODEL, "prompt": "x" * 70000})
    check_error(s, b, 413)
    s, b, _ = raw("POST", "/v1/completions", b" " * 70000)
    check_error(s, b, 413)
    c2 = http.client.HTTPConnection("127.0.0.1", SRV.port, timeout=60)  # no Content-Length: chunked upload
    c2.request("POST", "/v1/completions", body=iter([b" " * 8192] * 10), encode_chunked=True,
               headers={"Authorization": f"Bearer {KEY}", "Transfer-Encoding": "chunked"})
    r = c2.getresponse()
    check_error(r.status, json.loads(r.read()), 413)
    c2.close()
    long_prompt = " ".join(["the cat sat on the mat"] * 200)
    try:
        c.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2)
        raise AssertionError("over-long prompt accepted")
    except openai.BadRequestError as e:
        assert e.status_code == 400 and e.body["code"] == "context_length_exceeded", e.body
    try:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_prompt}], max_tokens=2)
        raise AssertionError("over-long chat accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "messages", e.body
    # max_tokens beyond the context is cut to what is left
    r = c.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=100000, temperature=0, logit_bias={"2": -100})
    assert r.choices[0].finish_reason == "length" and r.usage.total_tokens == 512, r.usage


@test
def error_api_key():
    for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}, {"Authorization": "Bearer "}]:
        for method, path, body in [("GET", "/v1/models", None), ("POST", "/v1/completions", {"prompt": "x"})]:
            s, b, _ = raw(method, path, body, headers=headers, auth=False)
            check_error(s, b, 401)
    bad = openai.OpenAI(base_url=f"http://127.0.0.1:{SRV.port}/v1", api_key="nope", max_retries=0)
    try:
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
        raise AssertionError("bad key accepted")
    except openai.AuthenticationError as e:
        assert e.status_code == 401
    assert raw("GET", "/health", auth=False)[0] == 200


# ---------------------------------------------------------------- clients that leave

@test
def disconnect_cancels_jobs():
    before = wait_idle()["tokens_generated"]  # the server's count since it started: this test's is the difference
    # streaming: read a little, then hang up
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 480, "stream": True,
                       "logit_bias": {"2": -100}}).encode()
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", SRV.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(body)).encode() +
                  b"\r\n\r\n" + body)
        got = b""
        while got.count(b"data:") < 3:
            got += s.recv(4096)
        assert health()["jobs_running"] >= 1
        s.close()
    wait_idle()
    # not streaming: hang up before the answer
    nb = body.replace(b'"stream": true', b'"stream": false')
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", SRV.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Length: " + str(len(nb)).encode() + b"\r\n\r\n" + nb)
        time.sleep(0.2)
        s.close()
    h = wait_idle()
    assert h["tokens_generated"] - before < 6 * 480, (before, h)  # they did not run to the end
    assert client().completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None


# ---------------------------------------------------------------- exl chat

@test
def chat_cli_on_a_pipe():
    """`exl chat` reads lines from a pipe; its greedy reply equals the server's."""
    lines = "Tell me about a cat.\n/help\n/reset\n/bogus\nHi\n/exit\nnever read\n"
    out = subprocess.run([EXL, "chat", "-m", MODEL_DIR, "-n", "12", "--greedy", "--system", "You tell stories.",
                          "-t", "1"], input=lines, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    want = client().chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "You tell stories."},
        {"role": "user", "content": "Tell me about a cat."}]).choices[0].message.content
    assert out.stdout.startswith(want + "\n"), (out.stdout, want)
    assert "(conversation cleared)" in out.stdout and "unknown command /bogus" in out.stdout
    assert "/reset" in out.stdout  # the /help text


# ---------------------------------------------------------------- load and memory

def one_stream(i, n_tokens):
    p = PROMPTS[i % len(PROMPTS)]
    c = client()
    if i % 2:
        chunks = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                           max_tokens=n_tokens, temperature=0, stream=True)
        return ("chat", p, "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices))
    chunks = c.completions.create(model=MODEL, prompt=p, max_tokens=n_tokens, temperature=0, stream=True)
    return ("cmpl", p, "".join(ch.choices[0].text for ch in chunks if ch.choices))


def round_of(n_clients, n_tokens, chat_ref):
    with cf.ThreadPoolExecutor(n_clients) as ex:
        results = list(ex.map(lambda i: one_stream(i, n_tokens), range(n_clients)))
    for kind, p, text in results:
        want = reference(p, n_tokens)["text"] if kind == "cmpl" else chat_ref[p]
        assert text == want, (kind, p, text, want)


@test
def concurrent_32_and_flat_memory():
    n_tokens = 32
    chat_ref = {p: client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                                    max_tokens=n_tokens, temperature=0).choices[0].message.content
                for p in PROMPTS}
    for p in PROMPTS:
        reference(p, n_tokens)
    round_of(32, n_tokens, chat_ref)
    round_of(32, n_tokens, chat_ref)
    rss = [SRV.rss_kb()]
    for _ in range(6):
        round_of(32, n_tokens, chat_ref)
        rss.append(SRV.rss_kb())
    wait_idle()
    growth = rss[-1] - rss[0]
    # AddressSanitizer's allocator and quarantine move RSS by several MB on their own
    with open(f"/proc/{SRV.proc.pid}/maps") as f:
        limit = 16384 if "libasan" in f.read() else 4096
    print(f"    VmRSS over 6 rounds of 32 clients (kB): {rss}, limit +{limit}")
    assert growth < limit, f"VmRSS grew {growth} kB: {rss}"


# ---------------------------------------------------------------- main

def main():
    global SRV
    SRV = Server()
    passed = failed = 0
    try:
        for t in TESTS:
            t0 = time.time()
            try:
                t()
                passed += 1
                print(f"ok    {t.__name__} ({time.time() - t0:.1f}s)", flush=True)
            except Exception as e:  # report and go on
                failed += 1
                print(f"FAIL  {t.__name__}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    finally:
        rc = SRV.stop()
    if rc != 0:
        failed += 1
        SRV.log.seek(0)
        print(f"FAIL  clean_shutdown: exit status {rc}\n{SRV.log.read()[-4000:]}")
    else:
        passed += 1
        print("ok    clean_shutdown")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
