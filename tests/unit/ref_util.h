/* ref_util.h - helpers for tests that compare against ../shared/reference logits. */
#ifndef EXL_TEST_REF_UTIL_H
#define EXL_TEST_REF_UTIL_H

#include "exl.h"
#include "io/safetensors.h"

/* Relative L2 error ||a - b|| / ||b|| over n values. */
double ref_rel_err(const float *a, const float *b, int64_t n);
/* Index of the largest value. */
int64_t ref_argmax(const float *v, int64_t n);
/* Load model_dir, run each reference sequence (a, b, c when present) of ref_file in one
 * session, and return the worst per-position relative error against `key_prefix`
 * ("logits" or "e2logits"); *argmax_mismatch counts positions whose argmax differs.
 * Returns a negative value (after recording a failure) when something cannot run. */
double ref_compare_model(const char *model_dir, const char *ref_file, const char *key_prefix,
                         const exl_model_params *params, int *argmax_mismatch, int *positions);
/* Decode steps of several sequences against each sequence's step alone: REF_DECODE_SEQS sequences of distinct
 * prompts are prefilled one by one, then the next token of each is decoded alone, then the first k of them
 * together for each k of ks (at most REF_DECODE_SEQS), each row against that sequence's step alone. Returns the
 * worst relative error of a row's logits; *argmax_mismatch counts the rows whose argmax differs, *rows the rows
 * compared. Negative (after recording a failure) when something cannot run. */
#define REF_DECODE_SEQS 16
double ref_decode_rows(exl_model *m, const int32_t *ks, int n_ks, int *argmax_mismatch, int *rows);

#endif
