"""test_exl.py - the exl Python package against libexl and the reference greedy text of tinystories-656k."""
import json
import os
import threading
import time

import pytest

import exl

PROMPT = "Once upon a time"


def reference(shared, prompt=PROMPT):
    with open(os.path.join(shared, "reference", "tinystories-656k.json")) as f:
        return next(p for p in json.load(f)["prompts"] if p["prompt"] == prompt)


def test_generate_equals_reference_greedy_text(model, shared):
    text = model.generate(PROMPT, max_tokens=48, temperature=0)
    assert PROMPT + text == reference(shared)["greedy_text"]


def test_stream_joined_equals_generate(model, shared):
    pieces = list(model.stream(PROMPT, max_tokens=48, temperature=0))
    assert len(pieces) > 1
    assert PROMPT + "".join(pieces) == reference(shared)["greedy_text"]


def test_token_ids_prompt_and_job_details(model, shared):
    ref = reference(shared)
    job = model.submit(ref["ids"], max_tokens=48, temperature=0)
    assert PROMPT + job.result() == ref["greedy_text"]
    assert job.token_ids == ref["greedy_ids"][len(ref["ids"]):]
    assert job.finish_reason == "length" and job.n_prompt_tokens == len(ref["ids"])


def test_tokenize_detokenize(model, shared):
    ref = reference(shared)
    assert model.tokenize(PROMPT) == ref["ids"]
    assert model.tokenize(PROMPT, add_special=False) == ref["ids"][1:]
    assert model.detokenize(ref["ids"][1:]) == PROMPT
    assert model.detokenize(ref["greedy_ids"][1:]) == ref["greedy_text"]


def test_embedded_model_is_the_shared_one(model):
    default = exl.Model(device="cpu", threads=1)
    try:
        assert default.generate(PROMPT, max_tokens=16, temperature=0) == model.generate(PROMPT, max_tokens=16,
                                                                                        temperature=0)
    finally:
        default.close()


def test_stop_strings_and_seeds(model, shared):
    full = reference(shared)["greedy_text"][len(PROMPT):]
    assert model.generate(PROMPT, max_tokens=48, temperature=0, stop="Spot") == full[: full.index("Spot")]
    a = model.generate(PROMPT, max_tokens=24, temperature=1.0, top_p=0.9, seed=7)
    b = model.generate(PROMPT, max_tokens=24, temperature=1.0, top_p=0.9, seed=7)
    assert a == b


def test_chat_uses_the_template(model):
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "A story, please"}]
    ids, stops, stop_ids = model.chat_prompt(messages)
    # tinystories has no chat template: the ChatML fallback, ended by <|im_end|>
    assert "<|im_start|>user" in model.detokenize(ids, skip_special=False) and stops == ["<|im_end|>"]
    reply = model.chat(messages, max_tokens=16, temperature=0)
    assert reply == "".join(model.chat(messages, stream=True, max_tokens=16, temperature=0))
    assert reply == model.generate(ids, max_tokens=16, temperature=0, stop=stops, stop_ids=stop_ids)


def test_errors_carry_the_library_message(tmp_path):
    with pytest.raises(exl.FileError, match="config.json: cannot open"):
        exl.Model(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(exl.Error) as e:
        exl.Model(str(tmp_path))
    assert str(e.value) and e.value.status is not None
    with pytest.raises(exl.ArgumentError):
        exl.Model(str(tmp_path), device="tpu")


def test_bad_job_options_raise(model):
    with pytest.raises(exl.ArgumentError):
        model.generate(PROMPT, max_tokens=0)


def test_generator_runs_concurrent_jobs_from_threads(model, shared):
    want = model.generate(PROMPT, max_tokens=32, temperature=0)
    results = {}

    with model.generator(max_jobs=8) as gen:
        def worker(i):
            results[i] = gen.submit(PROMPT, max_tokens=32, temperature=0).result()

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        jobs = [gen.submit(PROMPT, max_tokens=32, temperature=0.8, seed=i) for i in range(4)]
        texts = [j.result() for j in jobs]
    assert all(results[i] == want for i in range(8))
    assert all(j.finish_reason in ("stop", "length") for j in jobs) and len(set(texts)) > 1


def test_leaving_a_stream_early_cancels_the_job(model):
    job = model.submit(PROMPT, max_tokens=200, temperature=0, ignore_eos=True)
    for _ in job:
        break
    # the cancel lands at the next step, taken by whoever steps next
    model.generate(PROMPT, max_tokens=2, temperature=0)
    assert job.finish_reason == "cancelled" and len(job.token_ids) < 200


def test_gil_is_released_while_the_engine_runs(model):
    """A Python thread keeps counting while another thread generates: ctypes drops the GIL around the C calls."""
    counts = []
    stop = threading.Event()

    def count():
        n = 0
        while not stop.is_set():
            n += 1
        counts.append(n)

    t = threading.Thread(target=count)
    t.start()
    start = time.time()
    model.generate(PROMPT, max_tokens=200, temperature=0, ignore_eos=True)
    elapsed = time.time() - start
    stop.set()
    t.join()
    assert counts[0] > 1000 and elapsed > 0


def test_quantized_cache_and_device_options(shared):
    m = exl.Model(os.path.join(shared, "models", "tinystories-656k"), device="cpu", cache_bits=(8, 4),
                  cache_tokens=1024, max_jobs=4, threads=1)
    try:
        text = m.generate(PROMPT, max_tokens=24, temperature=0)
        assert m.device == "cpu" and len(text) > 20
    finally:
        m.close()
    with pytest.raises(exl.Error):
        exl.Model(os.path.join(shared, "models", "tinystories-656k"), device="cpu", cache_bits=5)
