"""_model.py - exl.Model: a loaded model with its tokenizer, and the one-call ways to use it: generate, stream,
chat, tokenize, detokenize."""
import ctypes
import os
import threading
import weakref

from . import _lib
from ._generator import Generator
from ._lib import lib

_DEVICES = {"auto": 0, "cpu": 1, "cuda": 2, "gpu": 2}
_HERE = os.path.dirname(os.path.abspath(__file__))


def default_model_path():
    """The embedded tinystories-656k: installed in the package, or in the source tree beside python/."""
    for path in (os.path.join(_HERE, "models", "tinystories-656k"),
                 os.path.join(_HERE, "..", "..", "models", "tinystories-656k")):
        if os.path.exists(os.path.join(path, "config.json")):
            return os.path.abspath(path)
    raise _lib.FileError("no model path given and the embedded tinystories-656k is not installed")


class Model:
    """A Hugging Face style model directory (config.json, safetensors, tokenizer) loaded by libexl.

    path: the directory (None: the embedded tinystories-656k). device: "auto" (the GPU when one is usable),
    "cpu" or "cuda". cache_bits: bits per cached key and value (16, 8, 6, 4, or a (k, v) pair); cache_tokens: the
    KV cache's size in tokens; max_jobs: jobs that generate(), stream() and chat() run at once when called from
    several threads. threads: CPU worker threads (0: one per core)."""

    def __init__(self, path=None, device="auto", cache_bits=16, cache_tokens=None, max_jobs=None, threads=0):
        self._model = None
        self._tok = None
        self._generators = weakref.WeakSet()
        self._step_lock = threading.RLock()
        if device not in _DEVICES:
            raise _lib.ArgumentError(f"unknown device '{device}' (auto, cpu or cuda)")
        self.path = os.path.abspath(path) if path is not None else default_model_path()
        params = lib.exl_model_default_params()
        params.device = _DEVICES[device]
        params.n_threads = threads
        m, t = ctypes.c_void_p(), ctypes.c_void_p()
        _lib.check(lib.exl_model_load(self.path.encode(), ctypes.byref(params), ctypes.byref(m)))
        self._model = m
        _lib.check(lib.exl_tokenizer_load(self.path.encode(), ctypes.byref(t)))
        self._tok = t
        desc = _lib.ModelDesc()
        lib.exl_model_describe(self._model, ctypes.byref(desc))
        self.arch = desc.arch.decode()
        self.device = desc.backend.decode()
        self.vocab_size = desc.vocab_size
        self.max_context = desc.max_position_embeddings
        self.eos_token_ids = list(desc.eos_token_ids[: desc.n_eos_token_ids])
        self._generator = self.generator(max_jobs=max_jobs, cache_tokens=cache_tokens, cache_bits=cache_bits)

    # ---------------------------------------------------------------- generation

    def generator(self, **options):
        """A new exl.Generator on this model (options: max_jobs, cache_tokens, cache_bits, page_size)."""
        self._check_open()
        g = Generator(self, **options)
        self._generators.add(g)
        return g

    def submit(self, prompt, **options):
        """Queue a job on the model's own generator and return its exl.Job (iterate it, or call result())."""
        self._check_open()
        return self._generator.submit(prompt, **options)

    def generate(self, prompt, max_tokens=256, temperature=1.0, top_p=1.0, stop=None, seed=None, **options):
        """The completion of prompt (text, or a list of token ids) as one string, without the prompt.

        temperature 0 is greedy. Further options: top_k, min_p, typical_p, repetition_penalty, frequency_penalty,
        presence_penalty, stop_ids, ignore_eos, min_tokens, add_special (text prompts: the tokenizer's BOS),
        priority. stop: a string or list of strings that end the text before them. seed None: a random one."""
        return self.submit(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop, seed=seed,
                           **options).result()

    def stream(self, prompt, max_tokens=256, temperature=1.0, top_p=1.0, stop=None, seed=None, **options):
        """As generate(), but yields the text in pieces as it is generated; leaving the loop early cancels the
        job."""
        return iter(self.submit(prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop,
                                seed=seed, **options))

    def chat_prompt(self, messages):
        """The conversation as prompt token ids through the model's chat template (ChatML when it has none),
        with what ends the reply: (ids, stop_strings, stop_ids)."""
        msgs = (_lib.ChatMessage * len(messages))()
        keep = []
        for i, m in enumerate(messages):
            for field in ("role", "content", "tool_call_id", "name"):
                if m.get(field) is not None:
                    value = str(m[field]).encode()
                    keep.append(value)
                    setattr(msgs[i], field, value)
        prompt = _lib.ChatPrompt()
        _lib.check(lib.exl_chat_encode(self._tok, msgs, len(messages), 1, None, ctypes.byref(prompt)))
        try:
            ids = prompt.ids[: prompt.n_ids]
            stop = [prompt.stop_string.decode()] if prompt.stop_string else []
            stop_ids = [prompt.stop_id] if prompt.stop_id >= 0 else []
        finally:
            lib.exl_chat_prompt_free(ctypes.byref(prompt))
        return ids, stop, stop_ids

    def chat(self, messages, stream=False, max_tokens=256, temperature=1.0, top_p=1.0, stop=None, seed=None,
             **options):
        """The assistant's reply to messages ([{"role": "system"|"user"|"assistant", "content": ...}, ...]), as
        one string, or with stream=True as an iterator of pieces."""
        ids, stops, stop_ids = self.chat_prompt(messages)
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        job = self.submit(ids, max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=stop + stops,
                          stop_ids=stop_ids + list(options.pop("stop_ids", None) or []), seed=seed, **options)
        return iter(job) if stream else job.result()

    # ---------------------------------------------------------------- tokenizer

    def tokenize(self, text, add_special=True):
        """Token ids of text; add_special applies the tokenizer's post-processor (BOS)."""
        self._check_open()
        data = text.encode()
        ids, n = ctypes.POINTER(ctypes.c_int32)(), ctypes.c_int32()
        _lib.check(lib.exl_tokenizer_encode(self._tok, data, len(data), 1 if add_special else 0, ctypes.byref(ids),
                                            ctypes.byref(n)))
        try:
            return ids[: n.value]
        finally:
            lib.exl_ids_free(ids)

    def detokenize(self, ids, skip_special=True):
        """The text of token ids (special tokens left out unless skip_special is False)."""
        self._check_open()
        array = (ctypes.c_int32 * len(ids))(*ids)
        out = ctypes.c_void_p()
        _lib.check(lib.exl_tokenizer_decode(self._tok, array, len(ids), 1 if skip_special else 0, ctypes.byref(out)))
        try:
            return ctypes.string_at(out).decode("utf-8", "replace")
        finally:
            lib.exl_string_free(out)

    # ---------------------------------------------------------------- lifetime

    def _check_open(self):
        if not self._model:
            raise _lib.StateError("the model is closed")

    def close(self):
        """Free the model, its tokenizer and its generators (also done when it is garbage collected)."""
        # the own generator by its strong reference too: a garbage-collected cycle clears the weak ones first
        for g in [self._generator, *self._generators] if getattr(self, "_generator", None) else list(self._generators):
            g.close()
        if self._tok:
            lib.exl_tokenizer_free(self._tok)
            self._tok = None
        if self._model:
            lib.exl_model_free(self._model)
            self._model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_model", None):
            self.close()

    def __repr__(self):
        return f"exl.Model({self.path!r}, arch={self.arch!r}, device={self.device!r})"
