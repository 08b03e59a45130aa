"""_lib.py - libexl through ctypes: the C structs of include/exl.h mirrored field by field, the functions' signatures,
and the library's errors as Python exceptions.

ctypes (not a CPython extension) keeps the wheel independent of the Python version (one py3-none wheel) and needs
no compiler at install time; ctypes.CDLL releases the GIL around every call, so the engine runs while other Python
threads go on. tests/test_layout.py compares every struct here with the C compiler's sizes and offsets.
"""
import ctypes
import os
from ctypes import POINTER, c_char, c_char_p, c_float, c_int32, c_size_t, c_uint64, c_void_p

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load():
    path = os.environ.get("EXL_LIBRARY") or os.path.join(_HERE, "libexl.so")
    # the CUDA backend shipped beside libexl.so, unless the environment names another
    cuda = os.path.join(_HERE, "libexl_cuda.so")
    if os.path.exists(cuda):
        os.environ.setdefault("EXL_CUDA_LIBRARY", cuda)
    return ctypes.CDLL(path)


lib = _load()

# ---------------------------------------------------------------- errors

OK, ERR_IO, ERR_FORMAT, ERR_UNSUPPORTED, ERR_NOMEM, ERR_ARG, ERR_DEVICE, ERR_STATE = range(8)


class Error(Exception):
    """A failed libexl call: str(e) is the library's message; e.status the exl_status code."""

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


class FileError(Error):
    """A file is missing, unreadable or truncated (EXL_ERR_IO)."""


class FormatError(Error):
    """A file is readable but malformed (EXL_ERR_FORMAT)."""


class UnsupportedError(Error):
    """Well-formed but not something exl can run (EXL_ERR_UNSUPPORTED)."""


class OutOfMemoryError(Error, MemoryError):
    """An allocation failed, on the host or the device (EXL_ERR_NOMEM)."""


class ArgumentError(Error, ValueError):
    """An invalid argument (EXL_ERR_ARG)."""


class DeviceError(Error):
    """The accelerator or its driver failed (EXL_ERR_DEVICE)."""


class StateError(Error):
    """The call is not valid in the object's current state (EXL_ERR_STATE)."""


_ERRORS = {ERR_IO: FileError, ERR_FORMAT: FormatError, ERR_UNSUPPORTED: UnsupportedError,
           ERR_NOMEM: OutOfMemoryError, ERR_ARG: ArgumentError, ERR_DEVICE: DeviceError, ERR_STATE: StateError}


def error(status, message=None):
    """The exception for a status, with the library's message of this thread's last failure."""
    if message is None:
        message = lib.exl_last_error().decode("utf-8", "replace") or lib.exl_status_str(status).decode()
    return _ERRORS.get(status, Error)(message, status)


def check(status):
    if status != OK:
        raise error(status)


# ---------------------------------------------------------------- structs (include/exl.h)

class ModelParams(ctypes.Structure):
    _fields_ = [("device", c_int32), ("n_threads", c_int32), ("load_only", c_int32), ("tp", c_int32),
                ("gpu_split", c_float * 16)]


class ModelDesc(ctypes.Structure):
    _fields_ = [("arch", c_char * 32), ("vocab_size", c_int32), ("hidden_size", c_int32),
                ("intermediate_size", c_int32), ("n_layers", c_int32), ("n_heads", c_int32), ("n_kv_heads", c_int32),
                ("head_dim", c_int32), ("max_position_embeddings", c_int32), ("bos_token_id", c_int32),
                ("n_eos_token_ids", c_int32), ("eos_token_ids", c_int32 * 8), ("tied_embeddings", c_int32),
                ("backend", c_char * 16), ("max_step_tokens", c_int32), ("decode_bytes", c_uint64),
                ("file_bytes", c_uint64), ("gen_do_sample", c_int32), ("gen_temperature", c_float),
                ("gen_top_p", c_float), ("gen_min_p", c_float), ("gen_repetition_penalty", c_float),
                ("gen_top_k", c_int32)]


class GeneratorParams(ctypes.Structure):
    _fields_ = [("n_pages", c_int32), ("page_size", c_int32), ("max_batch_tokens", c_int32), ("max_jobs", c_int32),
                ("prefix_cache", c_int32), ("cache_k_bits", c_int32), ("cache_v_bits", c_int32),
                ("memory_fraction", c_float), ("draft_model", c_void_p), ("draft_tokens", c_int32), ("ngram", c_int32),
                ("draft_fixed", c_int32)]


class LogitBias(ctypes.Structure):
    _fields_ = [("id", c_int32), ("bias", c_float)]


class Sampling(ctypes.Structure):
    _fields_ = [("temperature", c_float), ("top_k", c_int32), ("top_p", c_float), ("min_p", c_float),
                ("typical_p", c_float), ("tfs_z", c_float), ("mirostat", c_int32), ("mirostat_tau", c_float),
                ("mirostat_eta", c_float), ("repetition_penalty", c_float), ("frequency_penalty", c_float),
                ("presence_penalty", c_float), ("penalty_range", c_int32), ("logit_bias", POINTER(LogitBias)),
                ("n_logit_bias", c_int32), ("seed", c_uint64)]


class JobParams(ctypes.Structure):
    _fields_ = [("ids", POINTER(c_int32)), ("n_ids", c_int32), ("text", c_char_p), ("add_special", c_int32),
                ("max_new_tokens", c_int32), ("min_new_tokens", c_int32), ("stop_ids", POINTER(c_int32)),
                ("n_stop_ids", c_int32), ("ignore_eos", c_int32), ("stop_strings", POINTER(c_char_p)),
                ("n_stop_strings", c_int32), ("banned_strings", POINTER(c_char_p)), ("n_banned_strings", c_int32),
                ("logprobs", c_int32), ("top_logprobs", c_int32), ("priority", c_int32), ("constraint", c_void_p),
                ("sampling", Sampling), ("no_draft", c_int32), ("user", c_void_p), ("lora", c_void_p),
                ("n_lora", c_int32)]


class TokenLogprob(ctypes.Structure):
    _fields_ = [("id", c_int32), ("logprob", c_float)]


class GenEvent(ctypes.Structure):
    _fields_ = [("job", c_uint64), ("user", c_void_p), ("text", c_void_p), ("text_len", c_size_t),
                ("ids", POINTER(c_int32)), ("n_ids", c_int32), ("logprobs", POINTER(c_float)),
                ("top_logprobs", POINTER(TokenLogprob)), ("n_top_logprobs", c_int32), ("finish", c_int32),
                ("stop_token", c_int32), ("stop_string", c_char_p), ("n_prompt_tokens", c_int32),
                ("n_cached_tokens", c_int32), ("n_generated", c_int32), ("error", c_char_p),
                ("n_draft_proposed", c_int32), ("n_draft_accepted", c_int32)]


class ChatMessage(ctypes.Structure):
    _fields_ = [("role", c_char_p), ("content", c_char_p), ("tool_calls", c_char_p), ("tool_call_id", c_char_p),
                ("name", c_char_p)]


class ChatPrompt(ctypes.Structure):
    _fields_ = [("ids", POINTER(c_int32)), ("n_ids", c_int32), ("stop_string", c_char_p), ("stop_id", c_int32)]


# ---------------------------------------------------------------- functions

_p = c_void_p
_SIGNATURES = {
    "exl_status_str": (c_char_p, [c_int32]),
    "exl_last_error": (c_char_p, []),
    "exl_finish_reason_str": (c_char_p, [c_int32]),
    "exl_model_default_params": (ModelParams, []),
    "exl_model_load": (c_int32, [c_char_p, POINTER(ModelParams), POINTER(_p)]),
    "exl_model_free": (None, [_p]),
    "exl_model_describe": (None, [_p, POINTER(ModelDesc)]),
    "exl_tokenizer_load": (c_int32, [c_char_p, POINTER(_p)]),
    "exl_tokenizer_free": (None, [_p]),
    "exl_tokenizer_encode": (c_int32, [_p, c_char_p, c_size_t, c_int32, POINTER(POINTER(c_int32)), POINTER(c_int32)]),
    "exl_ids_free": (None, [POINTER(c_int32)]),
    "exl_tokenizer_decode": (c_int32, [_p, POINTER(c_int32), c_int32, c_int32, POINTER(c_void_p)]),
    "exl_string_free": (None, [c_void_p]),
    "exl_chat_encode": (c_int32, [_p, POINTER(ChatMessage), c_int32, c_int32, c_char_p, POINTER(ChatPrompt)]),
    "exl_chat_prompt_free": (None, [POINTER(ChatPrompt)]),
    "exl_generator_default_params": (GeneratorParams, []),
    "exl_generator_init": (c_int32, [_p, _p, POINTER(GeneratorParams), POINTER(_p)]),
    "exl_generator_free": (None, [_p]),
    "exl_generator_submit": (c_int32, [_p, POINTER(JobParams), POINTER(c_uint64)]),
    "exl_generator_cancel": (c_int32, [_p, c_uint64]),
    "exl_generator_step": (c_int32, [_p, POINTER(POINTER(GenEvent)), POINTER(c_int32)]),
    "exl_generator_pending": (c_int32, [_p]),
    "exl_job_default_params": (JobParams, []),
    "exl_sampling_default": (Sampling, []),
}
for _name, (_res, _args) in _SIGNATURES.items():
    _fn = getattr(lib, _name)
    _fn.restype, _fn.argtypes = _res, _args
