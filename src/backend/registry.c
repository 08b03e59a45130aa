/* registry.c - pick a backend: the CPU, or the CUDA library loaded at run time.
 *
 * The CUDA backend is a shared library (libexl_cuda.so) taken from $EXL_CUDA_LIBRARY if set,
 * else searched next to the running binary, in ../lib from it (an installed prefix), then on the
 * loader path (the Python package sets $EXL_CUDA_LIBRARY to the one in its wheel). It exports
 * exl_backend_cuda_create, exl_backend_cuda_create_on (a given device) and exl_backend_cuda_abi; a library built for
 * another version of the op table (EXL_BACKEND_ABI) is refused by name. Any failure to load it or to find a GPU
 * means "no GPU": AUTO falls back to the CPU, CUDA is an error.
 * The library has no error state of its own: before creating the backend we hand it
 * exl_backend_cuda_set_error_sink(core_error_sink), so its messages land in exl_last_error(). */
#include "backend/backend.h"

#include "base/error.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef exl_status (*cuda_create_fn)(exl_backend **out);
typedef exl_status (*cuda_create_on_fn)(int device, exl_backend **out);
typedef void (*cuda_error_sink_fn)(exl_status st, const char *msg);
typedef void (*cuda_set_sink_fn)(cuda_error_sink_fn sink);
typedef int (*cuda_abi_fn)(void);

static void core_error_sink(exl_status st, const char *msg) { exl_fail(st, "%s", msg); }

static void *open_cuda_library(char *why, size_t why_len) {
    const char *forced = getenv("EXL_CUDA_LIBRARY");
    if (forced && *forced) {
        void *h = dlopen(forced, RTLD_NOW | RTLD_LOCAL);
        if (!h)
            snprintf(why, why_len, "EXL_CUDA_LIBRARY=%s: %s", forced, dlerror());
        return h;
    }
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = 0;
        char *slash = strrchr(exe, '/');
        /* beside the binary (a build tree), then in ../lib (an installed prefix) */
        for (int installed = 0; slash && installed < 2; installed++) {
            char path[PATH_MAX + 32];
            snprintf(path, sizeof path, "%.*s/%slibexl_cuda.so", (int)(slash - exe), exe, installed ? "../lib/" : "");
            void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
            if (h)
                return h;
            if (access(path, F_OK) == 0) {
                snprintf(why, why_len, "%s", dlerror());
                return NULL;
            }
        }
    }
    void *h = dlopen("libexl_cuda.so", RTLD_NOW | RTLD_LOCAL);
    if (!h)
        snprintf(why, why_len, "the CUDA backend (libexl_cuda.so) is not installed next to the exl binary");
    return h;
}

exl_status exl_backend_init(exl_device device, int n_threads, exl_backend **out) {
    return exl_backend_init_ordinal(device, 0, n_threads, out);
}

exl_status exl_backend_init_ordinal(exl_device device, int ordinal, int n_threads, exl_backend **out) {
    *out = NULL;
    if (device != EXL_DEVICE_CPU) {
        char why[512] = "";
        void *lib = open_cuda_library(why, sizeof why);
        if (lib) {
            cuda_create_fn create = (cuda_create_fn)(uintptr_t)dlsym(lib, "exl_backend_cuda_create");
            cuda_create_on_fn create_on = (cuda_create_on_fn)(uintptr_t)dlsym(lib, "exl_backend_cuda_create_on");
            cuda_set_sink_fn set_sink = (cuda_set_sink_fn)(uintptr_t)dlsym(lib, "exl_backend_cuda_set_error_sink");
            cuda_abi_fn abi = (cuda_abi_fn)(uintptr_t)dlsym(lib, "exl_backend_cuda_abi");
            int lib_abi = abi ? abi() : 1;
            if (!create || !set_sink) {
                snprintf(why, sizeof why, "libexl_cuda.so lacks exl_backend_cuda_create or its error sink");
            } else if (lib_abi != EXL_BACKEND_ABI) {
                snprintf(why, sizeof why,
                         "libexl_cuda.so was built for another version of exl (backend interface %d; this exl "
                         "needs %d): install the libexl_cuda.so built with this exl",
                         lib_abi, EXL_BACKEND_ABI);
            } else if (ordinal && !create_on) {
                snprintf(why, sizeof why, "libexl_cuda.so lacks exl_backend_cuda_create_on (GPU %d)", ordinal);
            } else {
                set_sink(core_error_sink);
                exl_status st = ordinal ? create_on(ordinal, out) : create(out);
                if (st == EXL_OK)
                    return EXL_OK; /* the library stays loaded for the process lifetime */
                snprintf(why, sizeof why, "%s", exl_last_error());
            }
            dlclose(lib);
        }
        if (device == EXL_DEVICE_CUDA)
            return exl_fail(EXL_ERR_DEVICE, "no usable GPU: %s", why);
    }
    return exl_backend_cpu_init(n_threads, out);
}
