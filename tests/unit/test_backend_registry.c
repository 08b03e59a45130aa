/* test_backend_registry.c - choosing a backend: a CUDA library built for another version of
 * the op table is refused by name (the GPU asked for: an error; auto: the CPU). */
#include "backend/backend.h"
#include "exl.h"
#include "test.h"

#include <stdlib.h>
#include <string.h>

EXL_TEST(stale_cuda_library_is_refused) {
    setenv("EXL_CUDA_LIBRARY", EXL_STALE_CUDA_LIB, 1);
    exl_backend *be = NULL;
    exl_status st = exl_backend_init(EXL_DEVICE_CUDA, 1, &be);
    CHECK(st == EXL_ERR_DEVICE);
    CHECK(be == NULL);
    CHECK_MSG(strstr(exl_last_error(), "another version of exl"), "message: %s", exl_last_error());
    CHECK_MSG(strstr(exl_last_error(), "backend interface 1"), "message: %s", exl_last_error());
    st = exl_backend_init(EXL_DEVICE_AUTO, 1, &be);
    CHECK(st == EXL_OK);
    CHECK(be && !strcmp(be->name, "cpu"));
    if (be)
        be->ops->destroy(be);
    unsetenv("EXL_CUDA_LIBRARY");
}

EXL_TEST(missing_cuda_library_is_named) {
    setenv("EXL_CUDA_LIBRARY", "/nonexistent/libexl_cuda.so", 1);
    exl_backend *be = NULL;
    CHECK(exl_backend_init(EXL_DEVICE_CUDA, 1, &be) == EXL_ERR_DEVICE);
    CHECK_MSG(strstr(exl_last_error(), "EXL_CUDA_LIBRARY=/nonexistent/libexl_cuda.so"), "message: %s",
              exl_last_error());
    unsetenv("EXL_CUDA_LIBRARY");
}
