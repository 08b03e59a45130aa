#!/usr/bin/env python3
"""test_hardening.py - `exl serve` against slow, hostile and leaving clients (issue 30), over loopback only.

Usage: test_hardening.py EXL_BINARY SHARED_DIR

Python's standard library only (raw sockets and http.client). One test per defect of the review,
numbered as there: connection floods and slowloris, keyless bodies, non-streaming clients that
leave, SIGTERM, oversized responses, U+0000 and partial UTF-8, log injection, HTTP-level errors,
the Bearer scheme, a tokenizer too big for the model, silently ignored fields; then what came with
the fixes: /metrics, /tokenize and /detokenize, CORS, request ids, connection caps, the drain.

EXL_TEST_LEGACY=1 runs the suite against a server from before these fixes: the options it did not
have are left out, so each test meets the old behaviour instead of an unknown option.
Prints one line per test and closes with 'N passed, N failed'.
"""
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

EXL, SHARED = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
MODEL_DIR = os.path.join(SHARED, "models", "tinystories-656k")
MODEL = "tinystories-656k"
KEY = "sk-hardening"
LEGACY = os.environ.get("EXL_TEST_LEGACY") == "1"
OLD_OPTIONS = {"--host", "--port", "--api-key", "--model-name", "--max-jobs", "--ctx", "--max-body", "--quiet",
               "-m", "-t", "--threads", "--device"}
TMP = tempfile.mkdtemp(prefix="exl_hardening_")
TESTS = []


def test(fn):
    TESTS.append(fn)
    return fn


# ---------------------------------------------------------------- servers

class Server:
    def __init__(self, *extra, model_dir=MODEL_DIR, key=KEY, name="main"):
        args = ["--port", "0", "-t", "1", *extra] + (["--api-key", key] if key else [])
        if LEGACY:  # drop the options (and their values) the old server lacks
            kept, i = [], 0
            while i < len(args):
                if args[i] in OLD_OPTIONS:
                    kept += args[i:i + 2] if args[i] not in ("--quiet",) else args[i:i + 1]
                i += 1 if args[i] in ("--quiet",) else 2
            args = kept
        self.key = key
        self.log_path = os.path.join(TMP, f"{name}.log")
        self.log = open(self.log_path, "w+")
        self.proc = subprocess.Popen([EXL, "serve", "-m", model_dir, *args], stdout=subprocess.DEVNULL,
                                     stderr=self.log)
        deadline = time.time() + 60
        while time.time() < deadline:
            m = re.search(r"http://[^:]+:(\d+)/v1", self.text())
            if m:
                self.port = int(m.group(1))
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError("exl serve did not start: " + self.text())

    def text(self):
        self.log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()

    def status(self, field):
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(re.search(field + r":\s+(\d+)", f.read()).group(1))


def auth(srv):
    return {"Authorization": f"Bearer {srv.key}"} if srv.key else {}


def request(srv, method, path, body=None, headers=None, timeout=30, key=True):
    """(status, parsed JSON or text, headers) over http.client."""
    c = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=timeout)
    h = dict(auth(srv)) if key else {}
    if body is not None and not isinstance(body, bytes):
        body = json.dumps(body).encode()
        h["Content-Type"] = "application/json"
    h.update(headers or {})
    c.request(method, path, body=body, headers=h)
    r = c.getresponse()
    data = r.read()
    c.close()
    try:
        return r.status, json.loads(data), {k.lower(): v for k, v in r.getheaders()}
    except ValueError:
        return r.status, data.decode(errors="replace"), {k.lower(): v for k, v in r.getheaders()}


def completion(srv, **fields):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    body.update(fields)
    return request(srv, "POST", "/v1/completions", body)


def raw_exchange(srv, data, timeout=10, source=None):
    """Send raw bytes, read until the server closes; the raw answer."""
    s = socket.create_connection(("127.0.0.1", srv.port), timeout=timeout, source_address=source)
    s.sendall(data)
    got = b""
    try:
        while True:
            b = s.recv(65536)
            if not b:
                break
            got += b
    except (ConnectionResetError, socket.timeout):
        pass
    s.close()
    return got


def parse_answer(raw):
    """(status, headers, body) of one raw HTTP answer (Content-Length, chunked or to the end)."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode(errors="replace").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    if "content-length" in headers:
        return status, headers, rest[:int(headers["content-length"])]
    if headers.get("transfer-encoding") == "chunked":
        body, complete = dechunk(rest)
        headers["x-chunked-complete"] = complete
        return status, headers, body
    return status, headers, rest


def dechunk(data):
    """The body of a chunked stream, and whether its terminating chunk came."""
    body = b""
    while True:
        line, sep, data = data.partition(b"\r\n")
        if not sep:
            return body, False
        size = int(line.split(b";")[0], 16)
        if size == 0:
            return body, data.startswith(b"\r\n")
        body += data[:size]
        data = data[size + 2:]


def json_error(status, body, want_status, code=None, param=None):
    assert status == want_status, (status, body)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    e = body["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"], e
    if code is not None:
        assert e["code"] == code, e
    if param is not None:
        assert e["param"] == param, e


def metric(srv, name):
    s, text, _ = request(srv, "GET", "/metrics", key=False)
    assert s == 200, (s, text)
    m = re.search(r"^" + re.escape(name) + r" ([0-9.e+-]+)$", text, re.M)
    assert m, (name, text[:500])
    return float(m.group(1))


def jobs_running(srv):
    s, body, _ = request(srv, "GET", "/health", key=False)
    assert s == 200, (s, body)
    return body["jobs_running"] + body["jobs_waiting"]


def wait_for(cond, timeout, step=0.02):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


def post_head(srv, path, body, extra=b""):
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {srv.key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n").encode() + extra + b"\r\n" + body


# ---------------------------------------------------------------- 1. floods and slowloris

@test
def d1_idle_connections_do_not_stop_service():
    """300 connections that send nothing; a completion and /health still answer within 1 s."""
    idle = [socket.create_connection(("127.0.0.1", SRV.port), timeout=5) for _ in range(300)]
    try:
        time.sleep(0.2)
        t0 = time.time()
        s, body, _ = completion(SRV)
        took = time.time() - t0
        assert s == 200 and body["choices"][0]["text"], (s, body)
        assert took < 1.0, f"the completion took {took:.2f} s with 300 idle connections"
        t0 = time.time()
        assert request(SRV, "GET", "/health", key=False)[0] == 200
        assert time.time() - t0 < 1.0
        print(f"    completion in {took * 1e3:.0f} ms beside 300 idle connections")
    finally:
        for s in idle:
            s.close()


@test
def d1_trickled_heads_time_out():
    """Clients trickling a header line a second get 408 once --request-timeout (3 s) has passed,
    however many bytes they send; meanwhile /health answers."""
    socks = []
    for _ in range(50):
        s = socket.create_connection(("127.0.0.1", SRV.port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\n")
        socks.append(s)
    t0 = time.time()
    closed = {}
    while len(closed) < len(socks) and time.time() - t0 < 8:
        for i, s in enumerate(socks):
            if i in closed:
                continue
            try:
                s.sendall(b"X-Trickle: %d\r\n" % i)
            except OSError:
                closed[i] = (time.time() - t0, b"")
        assert request(SRV, "GET", "/health", key=False, timeout=2)[0] == 200
        time.sleep(1.0)
        for i, s in enumerate(socks):
            if i in closed:
                continue
            s.setblocking(False)
            try:
                got = s.recv(65536)
                closed[i] = (time.time() - t0, got)
            except BlockingIOError:
                pass
            except OSError:
                closed[i] = (time.time() - t0, b"")
            s.setblocking(True)
    for s in socks:
        s.close()
    assert len(closed) == len(socks), f"{len(socks) - len(closed)} trickling clients still open after 8 s"
    when = max(t for t, _ in closed.values())
    answers = [g for _, g in closed.values() if g]
    assert when < 6, f"the last trickling client was cut off only after {when:.1f} s"
    assert answers and all(g.startswith(b"HTTP/1.1 408") for g in answers), answers[:2]
    json.loads(parse_answer(answers[0])[2])


# ---------------------------------------------------------------- 2. keyless bodies

@test
def d2_keyless_bodies_are_refused_before_reading():
    """60 keyless clients sending 4 MiB bodies at once: each gets 401, RSS rises by < 40 MB."""
    body = b" " * (4 << 20)
    base = SRV.status("VmHWM")
    results = []

    def one():
        c = http.client.HTTPConnection("127.0.0.1", SRV.port, timeout=60)
        try:
            c.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            results.append((r.status, r.read()))
        except OSError as e:
            results.append((None, str(e).encode()))
        c.close()

    threads = [threading.Thread(target=one) for _ in range(60)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    peak = SRV.status("VmHWM")
    statuses = [s for s, _ in results]
    assert statuses.count(401) >= 55, statuses  # a reset may beat the answer now and then
    json_error(401, json.loads([b for s, b in results if s == 401][0]), 401)
    print(f"    VmHWM {base} -> {peak} kB")
    assert peak - base < 40 * 1024, f"peak RSS rose {(peak - base) / 1024:.0f} MB"


# ---------------------------------------------------------------- 3. non-streaming clients that leave

@test
def d3_nonstreaming_client_that_leaves_is_cancelled():
    """A non-streaming client hangs up while its tokens flow: exl_jobs_running is 0 within 1 s."""
    assert wait_for(lambda: jobs_running(SRV) == 0, 10)
    before = request(SRV, "GET", "/health", key=False)[1]["tokens_generated"]
    body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 500, "n": 16,
                       "logit_bias": {"2": -100}}).encode()
    s = socket.create_connection(("127.0.0.1", SRV.port))
    s.sendall(post_head(SRV, "/v1/completions", body))
    assert wait_for(lambda: jobs_running(SRV) > 0, 5), "the job never ran"
    s.close()
    t0 = time.time()
    gone = wait_for(lambda: jobs_running(SRV) == 0, 1.0)
    took = time.time() - t0
    made = request(SRV, "GET", "/health", key=False)[1]["tokens_generated"] - before
    print(f"    {'cancelled' if gone else 'still running'} {took * 1e3:.0f} ms after the close, {made} tokens "
          f"made of 8000 asked")
    assert gone and made < 4000, "the jobs ran on for a client that had left"
    assert metric(SRV, "exl_jobs_running") == 0


# ---------------------------------------------------------------- 5. oversized responses

@test
def d5_response_size_is_capped_up_front():
    rss = SRV.status("VmRSS")
    t0 = time.time()
    s, body, _ = completion(SRV, n=128, max_tokens=511, logprobs=20)
    json_error(s, body, 400, code="response_too_large")
    assert time.time() - t0 < 1.0 and "lower n, max_tokens or logprobs" in body["error"]["message"], body
    assert SRV.status("VmRSS") - rss < 20 * 1024
    s, body, _ = completion(SRV, n=4, max_tokens=16, logprobs=5)  # a reasonable one still runs
    assert s == 200 and len(body["choices"]) == 4, (s, body)


# ---------------------------------------------------------------- 6. U+0000 and partial UTF-8

@test
def d6_nul_in_a_prompt_is_refused():
    for prompt in ["\u0000hello", "hel\u0000lo"]:
        s, body, _ = completion(SRV, prompt=prompt)
        json_error(s, body, 400, code="unsupported_character")
    s, body, _ = request(SRV, "POST", "/v1/chat/completions",
                         {"model": MODEL, "messages": [{"role": "user", "content": "a\u0000b"}], "max_tokens": 2})
    json_error(s, body, 400, code="unsupported_character")
    s, body, _ = completion(SRV, prompt="a\\u0000 is text, not NUL")  # an escaped backslash: fine
    assert s == 200, (s, body)


def byte_model_dir():
    """tinystories' weights with a tokenizer of byte tokens only (llama2's first 259 ids): <0x00> is
    id 3, <0xE2> id 229, so logit_bias can make the model write them."""
    d = os.path.join(TMP, "bytes-model")
    if os.path.isdir(d):
        return d
    os.makedirs(d)
    for f in ("config.json", "model.safetensors", "generation_config.json"):
        os.symlink(os.path.join(MODEL_DIR, f), os.path.join(d, f))
    src = os.path.join(SHARED, "tokenizers", "llama2-hf")
    t = json.load(open(os.path.join(src, "tokenizer.json")))
    t["model"]["vocab"] = {k: v for k, v in t["model"]["vocab"].items() if v < 259}
    t["model"]["merges"] = []
    json.dump(t, open(os.path.join(d, "tokenizer.json"), "w"))
    for f in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(src, f), d)
    return d


@test
def d6_generated_nul_and_partial_utf8():
    srv = Server(model_dir=byte_model_dir(), key=None, name="bytes")
    try:
        # prompts of ids: every text is made of byte tokens here, and the prompt's would run into the reply's
        s, body, _ = completion(srv, prompt=[1], max_tokens=3, logit_bias={"3": 100}, model=None)
        assert s == 200 and body["choices"][0]["text"] == "\u0000" * 3, (s, body)
        s, raw, _ = request(srv, "POST", "/v1/completions", {"prompt": [1], "max_tokens": 3, "stream": True,
                                                             "logit_bias": {"3": 100}})
        chunks = [json.loads(line[6:]) for line in raw.split("\n") if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == "\u0000" * 3, raw
        s, body, _ = completion(srv, prompt=[1], max_tokens=2, logit_bias={"229": 100}, logprobs=2, model=None)
        lp = body["choices"][0]["logprobs"]
        assert s == 200 and lp["tokens"] == ["bytes:\\xe2"] * 2, (s, body)
        s, body, _ = request(srv, "POST", "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True,
                              "top_logprobs": 1, "logit_bias": {"229": 100}})
        content = body["choices"][0]["logprobs"]["content"]
        assert s == 200 and [c["bytes"] for c in content] == [[0xE2]] * 2, (s, body)
        assert content[0]["token"] == "bytes:\\xe2", content
        for t in [t for c in content for t in c["top_logprobs"]]:  # each alternative's bytes are its own
            want = (bytes.fromhex(t["token"][6:].replace("\\x", "")) if t["token"].startswith("bytes:")
                    else t["token"].encode())
            assert t["bytes"] == list(want), t
        s, body, _ = request(srv, "POST", "/detokenize", {"tokens": [3, 72, 3]})
        assert s == 200 and body == {"prompt": "\u0000E\u0000"}, (s, body)
    finally:
        srv.stop()


# ---------------------------------------------------------------- 7. the request log

@test
def d7_url_encoded_newlines_stay_in_their_log_line():
    raw_exchange(SRV, b"GET /x%0A2026-01-01%2000:00:00%20FORGED%0d%0a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    time.sleep(0.2)
    log = SRV.text()
    assert not re.search(r"^2026-01-01 00:00:00 FORGED", log, re.M), log[-2000:]
    assert "/x\\x0a2026-01-01 00:00:00 FORGED\\x0d\\x0a" in log, log[-2000:]


# ---------------------------------------------------------------- 8. HTTP-level errors

@test
def d8_http_errors_are_json():
    cases = [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20000 + b"\r\n\r\n", 431),
        (b"GET /health HTTP/2.0\r\nHost: x\r\n\r\n", 505),
        (b"GET /health HTTP/1.1\r\n\r\n", 400),  # no Host
        (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n folded\r\n\r\n", 400),
        (post_head(SRV, "/v1/completions", b"x" * (5 << 20))[:300], 413),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!", 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
         b"\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    ]
    for data, want in cases:
        status, headers, body = parse_answer(raw_exchange(SRV, data))
        assert status == want, (data[:80], status, body[:200])
        assert headers.get("content-type") == "application/json", (data[:80], headers)
        json_error(status, json.loads(body), want)


@test
def d8_unsupported_transfer_encoding_is_refused_at_once():
    t0 = time.time()
    data = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
            b"\r\nTransfer-Encoding: gzip\r\n\r\n\x1f\x8b")
    status, _, body = parse_answer(raw_exchange(SRV, data, timeout=5))
    assert time.time() - t0 < 1.0, f"answered after {time.time() - t0:.1f} s"
    json_error(status, json.loads(body), 501)


@test
def d8_chunked_and_pipelined_requests_work():
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 7]), body[i:i + 7]) for i in range(0, len(body), 7))
    data = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode() +
            b"\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked + b"0\r\nX-Trailer: 1\r\n\r\n" +
            b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    raw = raw_exchange(SRV, data)
    assert raw.count(b"HTTP/1.1 200 OK") == 3, raw[:1000]


# ---------------------------------------------------------------- 9. the Bearer scheme

@test
def d9_bearer_scheme_is_case_insensitive():
    for value in [f"bearer {KEY}", f"BEARER {KEY}", f"Bearer  {KEY}", f"beArer\t{KEY}"]:
        s, body, _ = request(SRV, "GET", "/v1/models", headers={"Authorization": value}, key=False)
        assert s == 200, (value, s, body)
    for value in [f"Basic {KEY}", f"Bearer{KEY}", f"Bearer {KEY}x", "bearer"]:
        s, body, h = request(SRV, "GET", "/v1/models", headers={"Authorization": value}, key=False)
        json_error(s, body, 401)
        assert h.get("www-authenticate") == "Bearer", h


# ---------------------------------------------------------------- 10. a tokenizer too big for the model

@test
def d10_tokenizer_beyond_the_vocabulary_is_refused_at_start():
    d = os.path.join(TMP, "big-tokenizer")
    os.makedirs(d, exist_ok=True)
    for f in ("config.json", "model.safetensors"):
        if not os.path.exists(os.path.join(d, f)):
            os.symlink(os.path.join(MODEL_DIR, f), os.path.join(d, f))
    shutil.copy(os.path.join(SHARED, "tokenizers", "llama2-hf", "tokenizer.json"), d)
    try:
        out = subprocess.run([EXL, "serve", "-m", d, "--port", "0", "-t", "1"], capture_output=True, text=True,
                             timeout=20)
    except subprocess.TimeoutExpired:
        raise AssertionError("the server started (and served) with a tokenizer the model cannot follow")
    assert out.returncode != 0, "the server started"
    assert "vocabulary" in out.stderr and "2048" in out.stderr, out.stderr


# ---------------------------------------------------------------- 11. fields that did nothing

@test
def d11_ignored_fields_are_refused():
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    for change, param in [({"modalities": ["text", "audio"]}, "modalities"), ({"modalities": "text"}, "modalities"),
                          ({"store": True}, "store"), ({"store": "yes"}, "store"),
                          ({"stream_options": {"include_usage": True}}, "stream_options")]:
        s, body, _ = request(SRV, "POST", "/v1/chat/completions", dict(chat, **change))
        json_error(s, body, 400, param=param)
    for change in [{"modalities": ["text"]}, {"store": False}, {"stream_options": None}]:
        s, body, _ = request(SRV, "POST", "/v1/chat/completions", dict(chat, **change))
        assert s == 200, (change, s, body)
    s, body, _ = completion(SRV, stream_options={"include_usage": True})
    json_error(s, body, 400, param="stream_options")


# ---------------------------------------------------------------- what came with the fixes

@test
def metrics_page():
    completion(SRV)
    s, text, h = request(SRV, "GET", "/metrics", key=False)
    assert s == 200 and h["content-type"].startswith("text/plain"), (s, h)
    for name in ["exl_jobs_running", "exl_jobs_waiting", "exl_kv_pages_used", "exl_kv_pages_total",
                 "exl_prompt_tokens_total", "exl_generated_tokens_total"]:
        assert re.search(r"^# TYPE %s (gauge|counter)$" % name, text, re.M), name
    assert re.search(r'^exl_requests_total\{code="200"\} [1-9]', text, re.M), text
    assert re.search(r'^exl_requests_total\{code="401"\} [1-9]', text, re.M), text
    for hist in ["exl_time_to_first_token_seconds", "exl_inter_token_seconds"]:
        assert re.search(r'^%s_bucket\{le="\+Inf"\} [1-9]' % hist, text, re.M), (hist, text)
        assert re.search(r"^%s_count [1-9]" % hist, text, re.M), hist
    assert metric(SRV, "exl_kv_pages_total") > 0 and metric(SRV, "exl_generated_tokens_total") > 0


@test
def request_ids_in_headers_and_log():
    s, body, h = completion(SRV)
    rid = h.get("x-request-id", "")
    assert s == 200 and re.fullmatch(r"req-[0-9a-f]{16}", rid), h
    assert request(SRV, "GET", "/nope", key=False)[2]["x-request-id"] != rid
    time.sleep(0.1)
    assert re.search(re.escape(rid) + r" POST /v1/completions 200 ", SRV.text()), SRV.text()[-1000:]


@test
def tokenize_and_detokenize():
    text = "Once upon a time, there was a cat."
    ids = subprocess.run([EXL, "tokenize", "-m", MODEL_DIR, "--special"], input=text, capture_output=True,
                         text=True, check=True).stdout.split()
    s, body, _ = request(SRV, "POST", "/tokenize", {"model": MODEL, "prompt": text})
    assert s == 200 and body["tokens"] == [int(i) for i in ids] and body["count"] == len(ids), (s, body, ids)
    assert body["max_model_len"] == 512, body
    s, plain, _ = request(SRV, "POST", "/tokenize", {"prompt": text, "add_special_tokens": False})
    s, back, _ = request(SRV, "POST", "/detokenize", {"tokens": plain["tokens"]})
    assert s == 200 and back == {"prompt": text}, (s, back)
    s, chat, _ = request(SRV, "POST", "/tokenize", {"messages": [{"role": "user", "content": text}]})
    assert s == 200 and chat["count"] > len(ids), chat
    json_error(*request(SRV, "POST", "/tokenize", {"prompt": text}, key=False)[:2], 401)
    json_error(*request(SRV, "POST", "/detokenize", {"tokens": [1, 99999]})[:2], 400, param="tokens")
    json_error(*request(SRV, "POST", "/tokenize", {"prompt": 5})[:2], 400, param="prompt")
    json_error(*request(SRV, "POST", "/tokenize", {"model": "x", "prompt": "a"})[:2], 404)
    json_error(*request(SRV, "GET", "/tokenize")[:2], 405)


@test
def cors():
    srv = Server("--cors-origin", "http://a.example,http://b.example", key=None, name="cors")
    try:
        s, body, h = request(srv, "OPTIONS", "/v1/chat/completions",
                             headers={"Origin": "http://b.example", "Access-Control-Request-Method": "POST",
                                      "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})
        assert s == 204 and h["access-control-allow-origin"] == "http://b.example", (s, h)
        assert "POST" in h["access-control-allow-methods"] and "x-stainless-os" in h["access-control-allow-headers"]
        s, body, h = request(srv, "GET", "/health", headers={"Origin": "http://a.example"})
        assert s == 200 and h["access-control-allow-origin"] == "http://a.example", h
        assert "x-request-id" in h["access-control-expose-headers"]
        s, body, h = request(srv, "GET", "/health", headers={"Origin": "http://evil.example"})
        assert s == 200 and "access-control-allow-origin" not in h, h
    finally:
        srv.stop()


@test
def connection_caps():
    """--max-client-connections 4 and --max-connections 6: the 5th from one address gets 429, the
    7th in all 503, each as JSON; freed slots are taken again."""
    srv = Server("--max-connections", "6", "--max-client-connections", "4", key=None, name="caps")
    try:
        def conn(src):
            return socket.create_connection(("127.0.0.1", srv.port), timeout=5, source_address=(src, 0))

        first = [conn("127.0.0.1") for _ in range(4)]
        time.sleep(0.1)
        status, _, body = parse_answer(raw_exchange(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
                                                    source=("127.0.0.1", 0)))
        json_error(status, json.loads(body), 429, code="too_many_connections")
        second = [conn("127.0.0.2") for _ in range(2)]
        time.sleep(0.1)
        status, _, body = parse_answer(raw_exchange(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
                                                    source=("127.0.0.2", 0)))
        json_error(status, json.loads(body), 503)
        for s in first + second:
            s.close()
        time.sleep(0.3)
        status, _, _ = parse_answer(raw_exchange(srv, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))
        assert status == 200
    finally:
        srv.stop()


# ---------------------------------------------------------------- 4. SIGTERM

def read_some(s, until, timeout=10):
    got = b""
    deadline = time.time() + timeout
    while until not in got and time.time() < deadline:
        b = s.recv(65536)
        if not b:
            break
        got += b
    return got


def read_all(s, timeout=15):
    s.settimeout(timeout)
    got = b""
    while True:
        try:
            b = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not b:
            break
        got += b
    return got


@test
def d4_sigterm_ends_streams_and_waiters_cleanly():
    """--drain-timeout 0: a stream in progress ends with an SSE error event, [DONE] and the last
    chunk; a waiting non-streaming client gets 503; the process exits 0."""
    srv = Server("--drain-timeout", "0", "--max-jobs", "4", name="sigterm")
    try:
        stream = socket.create_connection(("127.0.0.1", srv.port))
        body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 500, "n": 4,
                           "stream": True, "logit_bias": {"2": -100}}).encode()
        stream.sendall(post_head(srv, "/v1/completions", body))
        first = read_some(stream, b"\"text\"")
        waiter = socket.create_connection(("127.0.0.1", srv.port))
        body = json.dumps({"model": MODEL, "prompt": "One day", "max_tokens": 500,
                           "logit_bias": {"2": -100}}).encode()
        waiter.sendall(post_head(srv, "/v1/completions", body))
        time.sleep(0.05)
        srv.proc.send_signal(signal.SIGTERM)
        raw = first + read_all(stream)
        status, headers, sse = parse_answer(raw)
        events = [e for e in sse.decode(errors="replace").split("\n\n") if e.strip()]
        assert status == 200 and headers.get("x-chunked-complete"), (status, headers, raw[-300:])
        assert events[-1] == "data: [DONE]", events[-3:]
        last = json.loads(events[-2][6:])
        assert "error" in last and last["error"]["type"] == "server_error", events[-2]
        w_status, _, w_body = parse_answer(read_all(waiter))
        json_error(w_status, json.loads(w_body), 503)
        rc = srv.proc.wait(timeout=15)
        assert rc == 0, f"exit status {rc}"
    finally:
        srv.stop()


@test
def d4_sigterm_drains_requests_in_progress():
    """--drain-timeout 30: a stream in progress runs to its end; new connections are refused."""
    srv = Server("--drain-timeout", "30", name="drain")
    try:
        stream = socket.create_connection(("127.0.0.1", srv.port))
        body = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 100, "n": 4,
                           "stream": True, "logit_bias": {"2": -100}}).encode()
        stream.sendall(post_head(srv, "/v1/completions", body))
        first = read_some(stream, b"\"text\"")
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        try:
            socket.create_connection(("127.0.0.1", srv.port), timeout=2).close()
            refused = False
        except OSError:
            refused = True
        raw = first + read_all(stream)
        status, headers, sse = parse_answer(raw)
        events = [e for e in sse.decode(errors="replace").split("\n\n") if e.strip()]
        chunks = [json.loads(e[6:]) for e in events[:-1]]
        assert not [c for c in chunks if "error" in c], "cut off while draining: " + events[-2]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks]
        assert events[-1] == "data: [DONE]" and finishes.count("length") == 4, events[-3:]
        assert headers.get("x-chunked-complete"), headers
        assert srv.proc.wait(timeout=30) == 0
        assert refused, "a new connection was accepted while draining"
    finally:
        srv.stop()


# ---------------------------------------------------------------- main

def main():
    global SRV
    SRV = Server("--request-timeout", "3")
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
                print(f"FAIL  {t.__name__}: {type(e).__name__}: {str(e)[:1500]}", flush=True)
    finally:
        rc = SRV.stop()
    if rc != 0:
        failed += 1
        print(f"FAIL  clean_shutdown: exit status {rc}\n{SRV.text()[-3000:]}")
    else:
        passed += 1
        print("ok    clean_shutdown")
    shutil.rmtree(TMP, ignore_errors=True)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
