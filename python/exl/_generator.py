"""_generator.py - exl.Generator and exl.Job: many jobs through one model at once (continuous batching).

No thread of its own: whichever Python thread waits for a job's text runs the next step (under the model's step
lock, with the GIL released by ctypes while the engine runs) and hands every job its share of the events, so any
number of threads can each follow their own jobs.
"""
import collections
import ctypes
import os

from . import _lib
from ._lib import lib

_FINISH = {0: None, 1: "stop", 2: "length", 3: "cancelled", 4: "error"}


def _strings(values):
    """A list of str (or one str, or None) as a C array of UTF-8 strings."""
    if values is None:
        return None, 0
    if isinstance(values, str):
        values = [values]
    array = (ctypes.c_char_p * len(values))(*[v.encode() for v in values])
    return array, len(values)


def job_params(prompt, max_tokens=256, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0,
               typical_p=1.0, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, stop=None,
               stop_ids=None, seed=None, ignore_eos=False, min_tokens=0, add_special=True, priority=0):
    """exl_job_params for a prompt (str or token ids), and the ctypes objects it points to (keep them until
    submitted). seed None draws one from os.urandom."""
    p = lib.exl_job_default_params()
    keep = []
    if isinstance(prompt, str):
        text = prompt.encode()
        keep.append(text)
        p.text = text
        p.add_special = 1 if add_special else 0
    else:
        ids = (ctypes.c_int32 * len(prompt))(*prompt)
        keep.append(ids)
        p.ids, p.n_ids = ids, len(prompt)
    p.max_new_tokens = max_tokens
    p.min_new_tokens = min_tokens
    p.ignore_eos = 1 if ignore_eos else 0
    p.priority = priority
    strings, n = _strings(stop)
    if n:
        keep.append(strings)
        p.stop_strings, p.n_stop_strings = strings, n
    if stop_ids:
        sid = (ctypes.c_int32 * len(stop_ids))(*stop_ids)
        keep.append(sid)
        p.stop_ids, p.n_stop_ids = sid, len(stop_ids)
    s = p.sampling
    s.temperature, s.top_p, s.top_k, s.min_p, s.typical_p = temperature, top_p, top_k, min_p, typical_p
    s.repetition_penalty, s.frequency_penalty, s.presence_penalty = (repetition_penalty, frequency_penalty,
                                                                       presence_penalty)
    s.seed = int.from_bytes(os.urandom(8), "little") if seed is None else seed
    return p, keep


class Job:
    """One submitted job. Iterate it for the text as it is generated (pieces of whole characters), or call
    result() for all of it. After the end: finish_reason ("stop", "length", "cancelled"), text, token_ids,
    n_prompt_tokens."""

    def __init__(self, generator, job_id):
        self._gen = generator
        self.id = job_id
        self._pieces = collections.deque()
        self.text = ""
        self.token_ids = []
        self.finish_reason = None
        self.n_prompt_tokens = 0
        self._error = None

    @property
    def done(self):
        return self.finish_reason is not None

    def _event(self, e):
        if e.text_len:
            piece = ctypes.string_at(e.text, e.text_len).decode("utf-8", "replace")
            self.text += piece
            self._pieces.append(piece)
        self.token_ids.extend(e.ids[i] for i in range(e.n_ids))
        self.n_prompt_tokens = e.n_prompt_tokens
        if e.finish:
            if e.finish == 4:
                self._error = (e.error or b"generation failed").decode("utf-8", "replace")
            self.finish_reason = _FINISH.get(e.finish, "error")

    def __iter__(self):
        try:
            while True:
                while self._pieces:
                    yield self._pieces.popleft()
                if self.done:
                    break
                self._gen._advance(self)
            if self._error is not None:
                raise _lib.Error(self._error)
        finally:
            if not self.done:  # the caller stopped reading: the job ends at the next step
                self.cancel()

    def result(self):
        """All the text (blocks until the job ends)."""
        for _ in self:
            pass
        return self.text

    def cancel(self):
        """Ask the job to end (finish_reason "cancelled"); no effect once it has ended."""
        if not self.done and self._gen._handle:
            lib.exl_generator_cancel(self._gen._handle, self.id)


class Generator:
    """Runs many jobs through one Model at once over a shared paged KV cache.

    max_jobs: jobs running together (others wait); cache_tokens: tokens the cache holds (None: the library's
    default, 16384); cache_bits: 16, 8, 6 or 4 bits per cached key and value, or a (k_bits, v_bits) pair."""

    def __init__(self, model, max_jobs=None, cache_tokens=None, cache_bits=16, page_size=256):
        self.model = model
        self._handle = None
        gp = lib.exl_generator_default_params()
        gp.page_size = page_size
        if cache_tokens is not None:
            gp.n_pages = max(1, -(-cache_tokens // page_size))
        if max_jobs is not None:
            gp.max_jobs = max_jobs
        k, v = (cache_bits, cache_bits) if isinstance(cache_bits, int) else cache_bits
        gp.cache_k_bits, gp.cache_v_bits = k, v
        h = ctypes.c_void_p()
        _lib.check(lib.exl_generator_init(model._model, model._tok, ctypes.byref(gp), ctypes.byref(h)))
        self._handle = h
        self._jobs = {}

    def submit(self, prompt, **options):
        """Queue a job: prompt is text or a list of token ids; options as Model.generate's. Returns a Job."""
        p, keep = job_params(prompt, **options)
        job_id = ctypes.c_uint64()
        with self.model._step_lock:
            self._check_open()
            _lib.check(lib.exl_generator_submit(self._handle, ctypes.byref(p), ctypes.byref(job_id)))
            job = Job(self, job_id.value)
            self._jobs[job.id] = job
        del keep
        return job

    def pending(self):
        """Jobs submitted and not yet finished."""
        return lib.exl_generator_pending(self._handle) if self._handle else 0

    def _check_open(self):
        if not self._handle:
            raise _lib.StateError("the generator is closed")

    def _advance(self, job):
        """Run one step unless another thread's step already gave the job something."""
        with self.model._step_lock:
            if job._pieces or job.done:
                return
            self._check_open()
            events = ctypes.POINTER(_lib.GenEvent)()
            n = ctypes.c_int32()
            st = lib.exl_generator_step(self._handle, ctypes.byref(events), ctypes.byref(n))
            message = lib.exl_last_error().decode("utf-8", "replace") if st != _lib.OK else None
            for i in range(n.value):
                e = events[i]
                j = self._jobs.get(e.job)
                if j is not None:
                    j._event(e)
                    if j.done:
                        del self._jobs[e.job]
            if st != _lib.OK and not job.done:
                raise _lib.error(st, message)

    def close(self):
        """Free the generator (unfinished jobs end as cancelled)."""
        with self.model._step_lock:
            for j in self._jobs.values():
                j.finish_reason = j.finish_reason or "cancelled"
            self._jobs.clear()
            if self._handle:
                lib.exl_generator_free(self._handle)
                self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_handle", None) and getattr(self.model, "_model", None):
            self.close()
