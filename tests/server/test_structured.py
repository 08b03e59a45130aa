#!/usr/bin/env python3
"""test_structured.py - structured output and tool calling of `exl serve`, driven by the official
`openai` package.

Usage: test_structured.py EXL_BINARY SHARED_DIR

For TinyStories and rand-llama (whose vocabulary has no braces or brackets: the grammar writes
them) it checks: response_format json_schema answers sampled at temperature 1.0 with 8 seeds all
parse and validate against a bounded schema, also with n > 1 and streamed; json_object answers are
objects; a forced tool call (tool_choice required or a named function) returns tool_calls whose
arguments validate against the tool's parameters, with finish_reason tool_calls; streamed tool
call deltas reassemble to the same call; tool results and past calls in the history are taken;
tool_choice none and auto; and the errors name the field at fault.
Prints one line per test and closes with 'N passed, N failed'.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import openai

EXL, SHARED = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
MODELS = ["tinystories-656k", "rand-llama"]
SEEDS = [1, 2, 3, 4, 5, 6, 7, 8]
TESTS = []

BOUNDED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "happy": {"type": "boolean"},
    },
    "required": ["name", "age", "colors", "happy"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "days": {"type": "integer", "minimum": 1, "maximum": 7},
                           "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "days", "unit"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
CLOCK = {"type": "function", "function": {"name": "what_time"}}


def test(fn):
    TESTS.append(fn)
    return fn


def validate(value, schema, path="$"):
    """The subset of JSON Schema these tests use; raises AssertionError naming the place."""
    if "enum" in schema:
        assert value in schema["enum"], f"{path}: {value!r} not in {schema['enum']}"
        return
    t = schema.get("type")
    if t == "object":
        assert isinstance(value, dict), f"{path}: not an object"
        props = schema.get("properties", {})
        for k in schema.get("required", []):
            assert k in value, f"{path}: {k} missing"
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(props), f"{path}: extra keys {set(value) - set(props)}"
        for k, v in value.items():
            if k in props:
                validate(v, props[k], f"{path}.{k}")
    elif t == "array":
        assert isinstance(value, list), f"{path}: not an array"
        assert len(value) <= schema.get("maxItems", len(value)), f"{path}: {len(value)} items"
        for i, v in enumerate(value):
            validate(v, schema.get("items", {}), f"{path}[{i}]")
    elif t == "string":
        assert isinstance(value, str) and len(value) <= schema.get("maxLength", len(value)), f"{path}: {value!r}"
    elif t == "integer":
        assert isinstance(value, int) and not isinstance(value, bool), f"{path}: {value!r} is not an integer"
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value), f"{path}: {value} out of range"
    elif t == "boolean":
        assert isinstance(value, bool), f"{path}: {value!r} is not a boolean"


# ---------------------------------------------------------------- servers

class Server:
    def __init__(self, model):
        self.log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"exl_structured_{model}.log"), "w+")
        self.proc = subprocess.Popen([EXL, "serve", "-m", os.path.join(SHARED, "models", model), "--port", "0",
                                      "-t", "1"], stdout=subprocess.DEVNULL, stderr=self.log)
        self.model = model
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

    def client(self):
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0, timeout=300)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


SERVERS = {}


def schema_format(schema, strict=True):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": strict}}


def chat(srv, **kw):
    kw.setdefault("messages", [{"role": "user", "content": "Tell me about a girl named Lily."}])
    return srv.client().chat.completions.create(model=srv.model, **kw)


# ---------------------------------------------------------------- response_format

@test
def json_schema_sampled_answers_validate():
    for model in MODELS:
        srv = SERVERS[model]
        for seed in SEEDS:
            r = chat(srv, response_format=schema_format(BOUNDED), temperature=1.0, seed=seed, max_tokens=400)
            c = r.choices[0]
            assert c.finish_reason == "stop", (model, seed, c)
            validate(json.loads(c.message.content), BOUNDED)


@test
def json_schema_n_choices_and_stream():
    srv = SERVERS["rand-llama"]
    r = chat(srv, response_format=schema_format(BOUNDED, strict=False), temperature=1.0, seed=11, n=3,
             max_tokens=400)
    assert len(r.choices) == 3
    for c in r.choices:
        validate(json.loads(c.message.content), BOUNDED)
    chunks = list(chat(srv, response_format=schema_format(BOUNDED), temperature=1.0, seed=11, max_tokens=400,
                       stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    validate(json.loads(text), BOUNDED)
    assert text == chat(srv, response_format=schema_format(BOUNDED), temperature=1.0, seed=11,
                        max_tokens=400).choices[0].message.content


@test
def json_object_answers_are_objects():
    srv = SERVERS["tinystories-656k"]
    for seed in SEEDS[:4]:
        r = chat(srv, response_format={"type": "json_object"}, temperature=1.0, seed=seed, max_tokens=300)
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict), r.choices[0].message.content
        else:  # an unbounded object may run out of tokens; what there is still starts one
            assert r.choices[0].message.content.startswith("{")


# ---------------------------------------------------------------- tools

def check_call(call, tool):
    assert call.type == "function" and re.fullmatch(r"call_[A-Za-z0-9]{24}", call.id), call
    assert call.function.name == tool["function"]["name"], call
    validate(json.loads(call.function.arguments), tool["function"].get("parameters", {"type": "object"}))


@test
def forced_tool_calls_validate():
    for model in MODELS:
        srv = SERVERS[model]
        for seed in SEEDS:
            named = seed % 2 == 0
            choice = {"type": "function", "function": {"name": "get_weather"}} if named else "required"
            r = chat(srv, tools=[CLOCK, WEATHER], tool_choice=choice, parallel_tool_calls=False, temperature=1.0,
                     seed=seed, max_tokens=400,
                     messages=[{"role": "user", "content": "What is the weather in Paris this week?"}])
            c = r.choices[0]
            assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1, (model, seed, c)
            call = c.message.tool_calls[0]
            check_call(call, WEATHER if call.function.name == "get_weather" else CLOCK)
            assert not named or call.function.name == "get_weather"


@test
def streamed_tool_call_deltas_reassemble():
    srv = SERVERS["tinystories-656k"]
    kw = dict(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=5,
              max_tokens=400, messages=[{"role": "user", "content": "Weather in Rome?"}])
    whole = chat(srv, **kw).choices[0].message.tool_calls[0]
    chunks = list(chat(srv, stream=True, **kw))
    calls, finish = {}, None
    for ch in chunks:
        for c in ch.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = d.id or slot["id"]
                if d.function:
                    slot["name"] += d.function.name or ""
                    slot["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and list(calls) == [0], (finish, calls)
    assert calls[0]["name"] == whole.function.name and calls[0]["arguments"] == whole.function.arguments, calls
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", calls[0]["id"]) and len(chunks) > 3


@test
def tool_history_and_choices_none_auto():
    srv = SERVERS["rand-llama"]  # its context (2048) has room for the tool prompt and the history
    history = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"days\": 1, \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"sky\": \"rain\"}"},
    ]
    plain = chat(srv, messages=history, max_tokens=8, temperature=0)
    none = chat(srv, messages=history, tools=[WEATHER], tool_choice="none", max_tokens=8, temperature=0)
    assert plain.choices[0].message.content == none.choices[0].message.content  # no tools shown with none
    assert not none.choices[0].message.tool_calls and none.choices[0].finish_reason in ("stop", "length")
    auto = chat(srv, messages=history, tools=[WEATHER], max_tokens=40, temperature=1.0, seed=3)
    c = auto.choices[0]
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens  # the tool prompt
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls"
        for call in c.message.tool_calls:
            check_call(call, WEATHER)
    else:
        assert c.finish_reason in ("stop", "length") and c.message.content is not None
    forced = chat(srv, messages=history, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                  max_tokens=300, temperature=1.0, seed=4)
    check_call(forced.choices[0].message.tool_calls[0], WEATHER)


@test
def errors_name_the_field():
    srv = SERVERS["tinystories-656k"]
    c = srv.client()
    cases = [
        (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools"),
        (dict(tools=[WEATHER, WEATHER]), "tools"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice"),
        (dict(response_format={"type": "xml"}), "response_format"),
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format"),
        (dict(response_format=schema_format({"type": "string", "format": "email"})), "response_format"),
    ]
    for kw, param in cases:
        try:
            c.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, **kw)
            raise AssertionError(f"accepted: {kw}")
        except openai.BadRequestError as e:
            assert e.status_code == 400 and e.body["param"] == param, (kw, e.body)
    try:
        c.chat.completions.create(model=srv.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                  response_format=schema_format({"type": "string", "format": "email"}))
    except openai.BadRequestError as e:
        assert "'format' is not supported" in e.body["message"], e.body
    try:
        c.completions.create(model=srv.model, prompt="Hi", max_tokens=4, extra_body={"tools": [WEATHER]})
        raise AssertionError("tools accepted on /v1/completions")
    except openai.BadRequestError as e:
        assert e.body["param"] == "tools"


# ---------------------------------------------------------------- main

def main():
    passed = failed = 0
    try:
        for m in MODELS:
            SERVERS[m] = Server(m)
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
        for srv in SERVERS.values():
            if srv.stop() != 0:
                failed += 1
                srv.log.seek(0)
                print(f"FAIL  clean_shutdown of {srv.model}\n{srv.log.read()[-4000:]}")
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
