/* registry.c - pick a backend: the CPU, or the CUDA library loaded at run time.
 *
 * The CUDA backend is a shared library (libexl_cuda.so) searched next to the running
 * binary, then on the loader path. It exports exl_backend_cuda_create. Any failure to
 * load it or to find a GPU means "no GPU": AUTO falls back to the CPU, CUDA is an error. */
#include "backend/backend.h"

#include "base/error.h"

#include <dlfcn.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

typedef exl_status (*cuda_create_fn)(exl_backend **out);

static void *open_cuda_library(char *why, size_t why_len) {
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = 0;
        char *slash = strrchr(exe, '/');
        if (slash) {
            char path[PATH_MAX + 32];
            snprintf(path, sizeof path, "%.*s/libexl_cuda.so", (int)(slash - exe), exe);
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
    *out = NULL;
    if (device != EXL_DEVICE_CPU) {
        char why[512] = "";
        void *lib = open_cuda_library(why, sizeof why);
        if (lib) {
            cuda_create_fn create = (cuda_create_fn)(uintptr_t)dlsym(lib, "exl_backend_cuda_create");
            if (!create) {
                snprintf(why, sizeof why, "libexl_cuda.so lacks exl_backend_cuda_create");
            } else {
                exl_status st = create(out);
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
