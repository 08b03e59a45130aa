/* default_model.h - where the embedded model (models/tinystories-656k, shipped with exl) is found when a
 * command is given no -m. */
#ifndef EXL_CLI_DEFAULT_MODEL_H
#define EXL_CLI_DEFAULT_MODEL_H

/* The name of the embedded model's directory. */
#define CLI_DEFAULT_MODEL_NAME "tinystories-656k"

/* The first directory holding the embedded model's config.json, searched in this order: beside the running binary
 * as installed (BINDIR/../share/exl/models/NAME), the install prefix it was built for (EXL_INSTALL_DATADIR), the
 * source tree it was built from (EXL_SOURCE_DIR/models/NAME). NULL when none has it. The string is static. */
const char *cli_default_model(void);

#endif
