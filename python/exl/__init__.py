"""exl - Python bindings of libexl, an inference engine for quantized LLMs (EXL2, GPTQ, fp16/bf16) on CPUs and
NVIDIA GPUs.

    import exl
    model = exl.Model()                      # the embedded tinystories-656k; or exl.Model("path/to/model")
    print(model.generate("Once upon a time", max_tokens=48, temperature=0))
    for piece in model.stream("Once upon a time", max_tokens=48):
        print(piece, end="", flush=True)
    model.chat([{"role": "user", "content": "Hi"}])

Errors raise exl.Error (subclasses by status) with the library's message; the engine runs with the GIL released.
"""
from ._generator import Generator, Job
from ._lib import (ArgumentError, DeviceError, Error, FileError, FormatError, OutOfMemoryError, StateError,
                   UnsupportedError)
from ._model import Model, default_model_path

__version__ = "0.2.0"
__all__ = ["Model", "Generator", "Job", "Error", "FileError", "FormatError", "UnsupportedError", "OutOfMemoryError",
           "ArgumentError", "DeviceError", "StateError", "default_model_path"]
