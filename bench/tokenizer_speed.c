/* tokenizer_speed.c - encode a text file with exl's tokenizer, single-threaded, and
 * print the best throughput of a few runs (built and run by tokenizer_speed.sh). */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "exl.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: tokenizer_speed MODEL_DIR TEXT_FILE [RUNS]\n");
        return 2;
    }
    int runs = argc > 3 ? atoi(argv[3]) : 5;
    FILE *f = fopen(argv[2], "rb");
    if (!f) {
        perror(argv[2]);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)len + 1);
    if (!text || fread(text, 1, (size_t)len, f) != (size_t)len) {
        fprintf(stderr, "cannot read %s\n", argv[2]);
        return 1;
    }
    fclose(f);
    exl_tokenizer *tok;
    double t0 = now();
    if (exl_tokenizer_load(argv[1], &tok) != EXL_OK) {
        fprintf(stderr, "%s\n", exl_last_error());
        return 1;
    }
    double load = now() - t0, best = 1e30;
    int32_t n = 0;
    for (int r = 0; r < runs; r++) {
        int32_t *ids;
        t0 = now();
        if (exl_tokenizer_encode(tok, text, (size_t)len, 0, &ids, &n) != EXL_OK) {
            fprintf(stderr, "%s\n", exl_last_error());
            return 1;
        }
        double dt = now() - t0;
        if (dt < best)
            best = dt;
        exl_ids_free(ids);
    }
    printf("exl %s: %ld bytes -> %d tokens, best of %d: %.3f s = %.2f MB/s (load %.2f s)\n", argv[1], len, n, runs,
           best, (double)len / best / 1e6, load);
    exl_tokenizer_free(tok);
    free(text);
    return 0;
}
