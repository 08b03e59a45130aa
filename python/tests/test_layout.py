"""test_layout.py - every ctypes struct of exl._lib has the size and field offsets that the C compiler gives the
struct of include/exl.h (a field added in C and not here fails this test). Needs a C compiler (CI has one)."""
import ctypes
import os
import shutil
import subprocess

import pytest

from exl import _lib

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
STRUCTS = {"exl_model_params": _lib.ModelParams, "exl_model_desc": _lib.ModelDesc,
           "exl_generator_params": _lib.GeneratorParams, "exl_logit_bias": _lib.LogitBias,
           "exl_sampling": _lib.Sampling, "exl_job_params": _lib.JobParams, "exl_token_logprob": _lib.TokenLogprob,
           "exl_gen_event": _lib.GenEvent, "exl_chat_message": _lib.ChatMessage, "exl_chat_prompt": _lib.ChatPrompt}


def test_structs_match_exl_h(tmp_path):
    cc = os.environ.get("CC") or shutil.which("cc")
    if not cc:
        pytest.fail("no C compiler to check the struct layouts with (set CC)")
    lines = ["#include <exl.h>", "#include <stddef.h>", "#include <stdio.h>", "int main(void) {"]
    for name, py in STRUCTS.items():
        lines.append(f'    printf("{name} %zu\\n", sizeof({name}));')
        for field, _ in py._fields_:
            lines.append(f'    printf("{name}.{field} %zu\\n", offsetof({name}, {field}));')
    lines += ["    return 0;", "}"]
    (tmp_path / "layout.c").write_text("\n".join(lines) + "\n")
    subprocess.run([cc, "-I", os.path.join(ROOT, "include"), str(tmp_path / "layout.c"), "-o",
                    str(tmp_path / "layout")], check=True)
    c = dict(line.rsplit(" ", 1) for line in subprocess.check_output([str(tmp_path / "layout")]).decode().split("\n")
             if line)
    for name, py in STRUCTS.items():
        assert int(c[name]) == ctypes.sizeof(py), f"{name}: C has {c[name]} bytes, exl._lib {ctypes.sizeof(py)}"
        for field, _ in py._fields_:
            assert int(c[f"{name}.{field}"]) == getattr(py, field).offset, f"{name}.{field} is elsewhere in C"


def test_version_matches_exl_h():
    import exl
    with open(os.path.join(ROOT, "include", "exl.h")) as f:
        text = f.read()
    parts = [text.split(f"#define EXL_VERSION_{p} ")[1].split()[0] for p in ("MAJOR", "MINOR", "PATCH")]
    assert exl.__version__ == ".".join(parts)
