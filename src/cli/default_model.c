/* default_model.c - find the embedded model for commands given no -m (see default_model.h). */
#include "default_model.h"

#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#define MODEL_SUBDIR "models/" CLI_DEFAULT_MODEL_NAME

static char found[PATH_MAX];

/* Whether dir/config.json exists; then dir is kept in found. */
static int try_dir(const char *dir) {
    char config[PATH_MAX + 16];
    if ((size_t)snprintf(config, sizeof config, "%s/config.json", dir) >= sizeof config || access(config, R_OK))
        return 0;
    snprintf(found, sizeof found, "%s", dir);
    return 1;
}

/* BINDIR/../share/exl/models/NAME for the running binary. */
static int try_beside_binary(void) {
    char exe[PATH_MAX], dir[PATH_MAX + 64];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0)
        return 0;
    exe[n] = 0;
    char *slash = strrchr(exe, '/');
    if (!slash)
        return 0;
    *slash = 0;
    snprintf(dir, sizeof dir, "%s/../share/exl/" MODEL_SUBDIR, exe);
    return try_dir(dir);
}

const char *cli_default_model(void) {
    if (try_beside_binary())
        return found;
#ifdef EXL_INSTALL_DATADIR
    if (try_dir(EXL_INSTALL_DATADIR "/exl/" MODEL_SUBDIR))
        return found;
#endif
#ifdef EXL_SOURCE_DIR
    if (try_dir(EXL_SOURCE_DIR "/" MODEL_SUBDIR))
        return found;
#endif
    return NULL;
}
