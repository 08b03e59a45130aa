/* progress.h - a one-line progress bar on stderr (only drawn when stderr is a terminal,
 * or when EXL_PROGRESS=1). */
#ifndef EXL_CLI_PROGRESS_H
#define EXL_CLI_PROGRESS_H

typedef struct cli_progress {
    const char *label;
    long total;
    double start;
    double last_draw;
    int enabled;
} cli_progress;

void cli_progress_begin(cli_progress *p, const char *label, long total);
/* done of total finished; extra: short text after the bar (may be NULL). */
void cli_progress_update(cli_progress *p, long done, const char *extra);
void cli_progress_end(cli_progress *p);

#endif
