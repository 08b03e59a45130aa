/* generate.c - the smallest program on libexl: load a model, complete a prompt greedily with the generator and
 * print the text as it comes. Built against an installed exl with pkg-config (examples/README.md):
 *     cc generate.c $(pkg-config --cflags --libs exl) -o generate && ./generate MODEL_DIR "Once upon a time" */
#include <exl.h>

#include <stdio.h>

/* Print the library's message for a failed call and give the exit status 1. */
static int fail(const char *what, exl_status st) {
    fprintf(stderr, "%s: %s: %s\n", what, exl_status_str(st), exl_last_error());
    return 1;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s MODEL_DIR PROMPT\n", argv[0]);
        return 2;
    }
    exl_model_params mp = exl_model_default_params();
    mp.device = EXL_DEVICE_CPU;
    exl_model *model = NULL;
    exl_tokenizer *tok = NULL;
    exl_generator *gen = NULL;
    exl_status st = exl_model_load(argv[1], &mp, &model);
    if (st != EXL_OK)
        return fail("load", st);
    if ((st = exl_tokenizer_load(argv[1], &tok)) == EXL_OK)
        st = exl_generator_init(model, tok, NULL, &gen);
    exl_job_params job = exl_job_default_params();
    job.text = argv[2];
    job.max_new_tokens = 32;
    job.sampling.temperature = 0; /* greedy */
    uint64_t id = 0;
    if (st == EXL_OK)
        st = exl_generator_submit(gen, &job, &id);
    printf("%s", argv[2]);
    while (st == EXL_OK && exl_generator_pending(gen) > 0) {
        const exl_gen_event *events;
        int32_t n;
        st = exl_generator_step(gen, &events, &n);
        for (int32_t i = 0; st == EXL_OK && i < n; i++)
            fwrite(events[i].text, 1, events[i].text_len, stdout);
    }
    printf("\n");
    int rc = st == EXL_OK ? 0 : fail("generate", st);
    exl_generator_free(gen);
    exl_tokenizer_free(tok);
    exl_model_free(model);
    return rc;
}
