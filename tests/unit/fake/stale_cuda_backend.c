/* stale_cuda_backend.c - a libexl_cuda.so as an older exl would have built it (no
 * exl_backend_cuda_abi, interface 1), for test_backend_registry: the core must refuse it
 * with a message, not call into it. */
#include <stddef.h>

typedef void (*error_sink)(int st, const char *msg);

void exl_backend_cuda_set_error_sink(error_sink sink);
int exl_backend_cuda_create(void **out);

void exl_backend_cuda_set_error_sink(error_sink sink) { (void)sink; }

int exl_backend_cuda_create(void **out) {
    *out = NULL;
    return 0; /* "OK" with no backend: using it would crash */
}
