/* membw.h - memory read bandwidth measurement for benchmark bounds. */
#ifndef EXL_CLI_MEMBW_H
#define EXL_CLI_MEMBW_H

#include <stddef.h>

/* Best of 5 timed reads of `bytes` split over n_threads; bytes per second. */
double exl_cli_read_bandwidth(int n_threads, size_t bytes);

#endif
