#!/usr/bin/env python3
"""test_web_chat.py - the web chat of `exl serve` (GET /) driven in headless Chromium.

Usage: test_web_chat.py EXL_BINARY SHARED_DIR [SCREENSHOT.png]

Starts the server with the TinyStories model and an API key, checks that GET / is the page (HTML, nothing loaded
from elsewhere), then drives Chromium through the DevTools protocol (a small websocket client below, standard
library only): the page asks for the key, the test types it; sets the sampling to greedy, types a system prompt
and a message, presses Enter; waits for the reply to stream in (several chunks, the cursor shown while streaming)
and compares it with the server's own greedy answer; sends a second message (the conversation goes along); checks
Markdown rendering, the stop button, that a reload keeps the conversation; and saves a screenshot.
Prints one line per check and closes with 'N passed, N failed'.
"""
import base64
import http.client
import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

EXL, SHARED = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
SHOT = sys.argv[3] if len(sys.argv) > 3 else os.path.join(tempfile.gettempdir(), "exl_web_chat.png")
KEY = "sk-web-test"
RESULTS = []


def check(name, ok, detail=""):
    RESULTS.append(bool(ok))
    print(f"{'ok  ' if ok else 'FAIL'} {name}{'' if ok else ': ' + detail}", flush=True)


# ---------------------------------------------------------------- a minimal websocket client (RFC 6455)

class WebSocket:
    def __init__(self, url):
        m = re.match(r"ws://([^:/]+):(\d+)(/.*)", url)
        self.sock = socket.create_connection((m.group(1), int(m.group(2))), timeout=60)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {m.group(3)} HTTP/1.1\r\nHost: {m.group(1)}:{m.group(2)}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
                          .encode())
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        if b" 101 " not in head.split(b"\r\n")[0]:
            raise RuntimeError("websocket handshake refused: " + head.decode(errors="replace"))

    def _read(self, n):
        out = b""
        while len(out) < n:
            got = self.sock.recv(n - len(out))
            if not got:
                raise RuntimeError("websocket closed")
            out += got
        return out

    def send(self, text):
        data = text.encode()
        head = bytes([0x81])
        if len(data) < 126:
            head += bytes([0x80 | len(data)])
        elif len(data) < 65536:
            head += bytes([0x80 | 126]) + struct.pack(">H", len(data))
        else:
            head += bytes([0x80 | 127]) + struct.pack(">Q", len(data))
        mask = os.urandom(4)
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))

    def recv(self):
        message = b""
        while True:
            b0, b1 = self._read(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._read(8))[0]
            payload = self._read(n)
            opcode = b0 & 0x0F
            if opcode == 8:
                raise RuntimeError("websocket closed by the browser")
            if opcode in (0, 1, 2):
                message += payload
                if b0 & 0x80:
                    return message.decode()


class Browser:
    """Headless Chromium with one page, driven over the DevTools protocol."""

    def __init__(self):
        exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
        if not exe:
            raise RuntimeError("no chromium: install the Debian package 'chromium' (.ci/run does)")
        self.profile = tempfile.mkdtemp(prefix="exl-chromium-")
        self.proc = subprocess.Popen([exe, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
                                      "--disable-extensions", "--disable-dev-shm-usage", "--remote-debugging-port=0",
                                      f"--user-data-dir={self.profile}", "--window-size=1100,760", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = os.path.join(self.profile, "DevToolsActivePort")
        deadline = time.time() + 60
        while not os.path.exists(port_file) or not open(port_file).read().strip():
            if time.time() > deadline or self.proc.poll() is not None:
                raise RuntimeError("chromium did not start")
            time.sleep(0.1)
        port = int(open(port_file).read().split()[0])
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("GET", "/json/list")
        page = next(t for t in json.loads(c.getresponse().read()) if t["type"] == "page")
        self.ws = WebSocket(page["webSocketDebuggerUrl"])
        self.next_id = 0

    def call(self, method, **params):
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def js(self, expression):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expression, timeout=30):
        deadline = time.time() + timeout
        while time.time() < deadline:
            value = self.js(expression)
            if value:
                return value
            time.sleep(0.02)
        raise RuntimeError(f"timed out waiting for {expression}")

    def click(self, selector):
        """A real mouse click at the middle of the element."""
        x, y = self.js(f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
                       f" return [r.x + r.width / 2, r.y + r.height / 2]; }})()")
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)

    def type(self, selector, text, replace=True):
        """Click into a field and type text as keyboard input (select-all first to replace what is there)."""
        self.click(selector)
        if replace:
            self.js(f"document.querySelector({json.dumps(selector)}).select()")
        self.call("Input.insertText", text=text)

    def key(self, key, code, keycode):
        for kind in ("keyDown", "keyUp"):
            self.call("Input.dispatchKeyEvent", type=kind, key=key, code=code, windowsVirtualKeyCode=keycode,
                      **({"text": "\r"} if kind == "keyDown" and key == "Enter" else {}))

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.profile, ignore_errors=True)


# ---------------------------------------------------------------- the server

def start_server():
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([EXL, "serve", "-m", os.path.join(SHARED, "models", "tinystories-656k"), "--port", "0",
                             "--api-key", KEY, "-t", "1"], stdout=subprocess.DEVNULL, stderr=log)
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


def greedy_answer(port, messages, max_tokens):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/chat/completions", json.dumps({"model": "tinystories-656k", "messages": messages,
                                                          "temperature": 0, "max_tokens": max_tokens}),
              {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    return json.loads(c.getresponse().read())["choices"][0]["message"]["content"]


def main():
    server, port = start_server()
    browser = None
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        c.request("GET", "/")
        r = c.getresponse()
        page = r.read().decode()
        check("GET / serves the page without an API key", r.status == 200 and
              r.getheader("Content-Type", "").startswith("text/html") and "<title>exl chat</title>" in page,
              f"{r.status} {r.getheader('Content-Type')}")
        external = re.findall(r"""(?:src|href)\s*=\s*["'](?:https?:)?//|@import|url\(\s*["']?(?:https?:)?//""", page)
        check("the page loads nothing from elsewhere", not external, str(external))

        browser = Browser()
        b = browser
        b.call("Page.navigate", url=f"http://127.0.0.1:{port}/")
        b.wait("document.readyState === 'complete' && !!document.getElementById('input')")
        b.wait("!document.getElementById('keybox').hidden")
        check("the page asks for the API key (the server answered 401)", True)
        b.type("#keyinput", KEY)
        b.click("#keysave")
        b.wait("document.getElementById('model').textContent.includes('tinystories-656k')")
        check("with the key, the page shows the model", True)

        system, question = "You tell short stories.", "Once upon a time"
        b.type("#temperature", "0")
        b.type("#max_tokens", "96")
        b.type("#system", system)
        b.type("#input", question)
        b.key("Enter", "Enter", 13)
        b.wait("document.querySelectorAll('.msg.assistant').length === 1")
        streaming_seen = b.wait("document.querySelector('.msg.assistant').dataset.streaming === 'true' || "
                                "document.querySelector('.msg.assistant').dataset.streaming === 'false'")
        b.wait("document.querySelector('.msg.assistant').dataset.streaming === 'false'", timeout=60)
        reply = b.js("document.querySelector('.msg.assistant .body').innerText")
        chunks = int(b.js("document.querySelector('.msg.assistant').dataset.chunks || '0'"))
        want = greedy_answer(port, [{"role": "system", "content": system}, {"role": "user", "content": question}], 96)
        check("the reply streamed in as several chunks", streaming_seen and chunks >= 5, f"{chunks} chunks")
        norm = lambda s: " ".join(s.split())
        check("the streamed reply is the server's greedy answer", norm(reply) == norm(want) and want,
              f"page: {reply!r}, server: {want!r}")
        check("the stop button is hidden again, send shown", b.js("document.getElementById('stop').hidden && "
                                                                 "!document.getElementById('send').hidden"))

        b.type("#input", "And then?")
        b.click("#send")
        b.wait("document.querySelectorAll('.msg.assistant').length === 2 && "
               "document.querySelectorAll('.msg.assistant')[1].dataset.streaming === 'false'", timeout=60)
        second = b.js("document.querySelectorAll('.msg.assistant')[1].querySelector('.body').innerText")
        want2 = greedy_answer(port, [{"role": "system", "content": system}, {"role": "user", "content": question},
                                     {"role": "assistant", "content": want}, {"role": "user", "content": "And then?"}],
                              96)
        check("the second turn carries the conversation", norm(second) == norm(want2), f"{second!r} vs {want2!r}")

        html = b.js("exlRenderMarkdown('# Title\\n**bold** and `x<y`\\n\\n```python\\nprint(\"<b>\")\\n```\\n- a\\n- b')")
        check("Markdown: headings, bold, inline code, code blocks, lists, HTML escaped",
              "<h1>Title</h1>" in html and "<strong>bold</strong>" in html and "<code>x&lt;y</code>" in html and
              '<pre><span class="lang">python</span><code>print(&quot;&lt;b&gt;&quot;)</code></pre>' in html and
              "<ul><li>a</li><li>b</li></ul>" in html, html)

        b.call("Emulation.setDeviceMetricsOverride", width=1100, height=760, deviceScaleFactor=1, mobile=False)
        shot = base64.b64decode(b.call("Page.captureScreenshot", format="png")["data"])
        with open(SHOT, "wb") as f:
            f.write(shot)
        check(f"screenshot saved ({SHOT}, {len(shot)} bytes)", shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 10000)

        # the stop button: a long reply, stopped while it streams (the job is cancelled when the page disconnects)
        b.type("#max_tokens", "4000")
        b.type("#temperature", "1")
        b.type("#input", "Tell me a very long story")
        b.key("Enter", "Enter", 13)
        b.wait("!document.getElementById('stop').hidden")
        b.click("#stop")
        b.wait("document.getElementById('stop').hidden && "
               "document.querySelectorAll('.msg.assistant')[2].dataset.streaming === 'false'")
        check("the stop button ends a streaming reply", True)

        b.type("#temperature", "0.5")
        b.click("#input")  # the field saves its setting when it loses the focus
        b.call("Page.reload")
        time.sleep(0.5)
        b.wait("document.readyState === 'complete' && document.querySelectorAll('.msg').length >= 5")
        check("a reload keeps the conversation and the settings",
              b.js("document.querySelectorAll('.msg.user').length") == 3 and
              norm(b.js("document.querySelectorAll('.msg.assistant')[1].innerText")).endswith(norm(want2)) and
              b.js("document.getElementById('temperature').value") == "0.5")
    except Exception as e:  # a failure to drive the page fails the test with its reason
        check("driving the page", False, f"{type(e).__name__}: {e}")
    finally:
        if browser:
            browser.close()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    passed = sum(RESULTS)
    print(f"{passed} passed, {len(RESULTS) - passed} failed")
    return 0 if passed == len(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
