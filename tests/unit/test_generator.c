/* test_generator.c - the generator against the transformers greedy reference (through
 * the C API and through `exl run`), batch invariance, per-job seeds whatever the batch,
 * submissions from another thread, priorities, and bad arguments. */
#include "base/alloc.h"
#include "gen_util.h"
#include "test.h"

#include <cjson/cJSON.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* ---------------------------------------------------------------- the reference */

typedef struct ref_prompt {
    char text[256];
    int32_t ids[64], n_ids;
    int32_t greedy[128], n_greedy; /* the completion only */
} ref_prompt;

static int load_reference(ref_prompt *out) {
    FILE *f = fopen(exl_test_shared("reference/tinystories-656k.json"), "rb");
    if (!f)
        return 0;
    static char buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    cJSON *root = cJSON_Parse(buf);
    int count = 0;
    const cJSON *p;
    cJSON_ArrayForEach(p, cJSON_GetObjectItem(root, "prompts")) {
        ref_prompt *r = &out[count++];
        snprintf(r->text, sizeof r->text, "%s", cJSON_GetObjectItem(p, "prompt")->valuestring);
        const cJSON *x;
        r->n_ids = r->n_greedy = 0;
        cJSON_ArrayForEach(x, cJSON_GetObjectItem(p, "ids")) r->ids[r->n_ids++] = x->valueint;
        int i = 0;
        cJSON_ArrayForEach(x, cJSON_GetObjectItem(p, "greedy_ids")) {
            if (i++ >= r->n_ids)
                r->greedy[r->n_greedy++] = x->valueint;
        }
        if (count == 3)
            break;
    }
    cJSON_Delete(root);
    return count;
}

static void check_same(const int32_t *got, int32_t n_got, const int32_t *want, int32_t n_want, const char *what) {
    int32_t first = -1;
    for (int32_t i = 0; i < n_want && i < n_got && first < 0; i++)
        if (got[i] != want[i])
            first = i;
    CHECK_MSG(n_got == n_want && first < 0, "%s: %d tokens vs %d expected, first difference at %d", what, n_got, n_want,
              first);
}

EXL_TEST(reference_greedy_api) {
    ref_prompt ref[3];
    REQUIRE(load_reference(ref) == 3);
    exl_tokenizer *tok;
    exl_model *m = gu_load("tinystories-656k", &tok);
    REQUIRE(m);
    exl_generator *g = gu_generator(m, tok, 0, 0, 0);
    gu_result *res = calloc(6, sizeof *res);
    exl_job_params p[6];
    for (int i = 0; i < 3; i++) { /* as text (post-processor adds BOS) and as the reference ids */
        p[i] = exl_job_default_params();
        p[i].text = ref[i].text;
        p[i].sampling.temperature = 0;
        p[i].max_new_tokens = 48;
        p[i + 3] = p[i];
        p[i + 3].text = NULL;
        p[i + 3].ids = ref[i].ids;
        p[i + 3].n_ids = ref[i].n_ids;
    }
    REQUIRE_OK(gu_run(g, p, 6, res));
    for (int i = 0; i < 6; i++) {
        check_same(res[i].ids, res[i].n_ids, ref[i % 3].greedy, ref[i % 3].n_greedy, ref[i % 3].text);
        CHECK(res[i].finish == EXL_FINISH_LENGTH);
    }
    free(res);
    exl_generator_free(g);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

EXL_TEST(reference_greedy_cli) {
    ref_prompt ref[3];
    REQUIRE(load_reference(ref) == 3);
    char cmd[8192];
    int len = snprintf(cmd, sizeof cmd, "%s run -m %s --greedy -n 48 --json --device cpu", EXL_CLI_PATH,
                       exl_test_shared("models/tinystories-656k"));
    for (int i = 0; i < 3; i++)
        len += snprintf(cmd + len, sizeof cmd - (size_t)len, " -p '%s'", ref[i].text);
    FILE *f = popen(cmd, "r");
    REQUIRE(f);
    char line[1 << 14];
    int n = 0;
    while (fgets(line, sizeof line, f) && n < 3) {
        cJSON *o = cJSON_Parse(line);
        REQUIRE(o);
        int32_t ids[256], n_ids = 0;
        const cJSON *x;
        cJSON_ArrayForEach(x, cJSON_GetObjectItem(o, "tokens")) ids[n_ids++] = x->valueint;
        CHECK(!strcmp(cJSON_GetObjectItem(o, "prompt")->valuestring, ref[n].text));
        CHECK(!strcmp(cJSON_GetObjectItem(o, "finish_reason")->valuestring, "length"));
        CHECK(cJSON_IsString(cJSON_GetObjectItem(o, "text")));
        check_same(ids, n_ids, ref[n].greedy, ref[n].n_greedy, ref[n].text);
        cJSON_Delete(o);
        n++;
    }
    CHECK(pclose(f) == 0);
    CHECK(n == 3);
    /* one prompt streams plain text */
    snprintf(cmd, sizeof cmd, "%s run -m %s --greedy -n 48 -p '%s'", EXL_CLI_PATH,
             exl_test_shared("models/tinystories-656k"), ref[0].text);
    f = popen(cmd, "r");
    REQUIRE(f);
    size_t got = fread(line, 1, sizeof line - 1, f);
    line[got] = 0;
    CHECK(pclose(f) == 0);
    CHECK_MSG(!strncmp(line, ", a little girl named Lily lived in a small house", 49), "streamed: %s", line);
}

/* ---------------------------------------------------------------- batch invariance */

/* Greedy continuations of 8 prompts of different lengths, alone and all together
 * (with a small token budget so the long prompts are prefilled in chunks). */
static void check_batch_invariance(const char *name) {
    exl_tokenizer *tok;
    exl_model *m = gu_load(name, &tok);
    REQUIRE(m);
    exl_model_desc d;
    exl_model_describe(m, &d);
    enum { N = 8 };
    static const int32_t lens[N] = {1, 5, 17, 64, 100, 190, 300, 3};
    static int32_t prompts[N][300];
    exl_job_params p[N];
    for (int i = 0; i < N; i++) {
        gu_random_ids(100 + i, prompts[i], lens[i], d.vocab_size);
        p[i] = exl_job_default_params();
        p[i].ids = prompts[i];
        p[i].n_ids = lens[i];
        p[i].sampling.temperature = 0;
        p[i].max_new_tokens = 20;
        p[i].ignore_eos = 1;
    }
    gu_result *alone = calloc(N, sizeof *alone), *together = calloc(N, sizeof *together);
    for (int i = 0; i < N; i++) {
        exl_generator *g = gu_generator(m, tok, 0, 0, 0);
        REQUIRE_OK(gu_run(g, &p[i], 1, &alone[i]));
        exl_generator_free(g);
    }
    exl_generator *g = gu_generator(m, tok, 0, 0, 96);
    REQUIRE_OK(gu_run(g, p, N, together));
    exl_generator_free(g);
    for (int i = 0; i < N; i++) {
        char what[64];
        snprintf(what, sizeof what, "%s prompt of %d tokens", name, lens[i]);
        CHECK(alone[i].n_ids == 20);
        check_same(together[i].ids, together[i].n_ids, alone[i].ids, alone[i].n_ids, what);
    }
    /* and the single job against a plain session's greedy loop */
    exl_session *s;
    REQUIRE_OK(exl_session_init(m, 512, &s));
    float *logits = malloc((size_t)d.vocab_size * sizeof *logits);
    int32_t next[20];
    REQUIRE_OK(exl_session_eval(s, prompts[5], lens[5], NULL, logits));
    for (int t = 0; t < 20; t++) {
        int32_t best = 0;
        for (int32_t v = 1; v < d.vocab_size; v++)
            best = logits[v] > logits[best] ? v : best;
        next[t] = best;
        REQUIRE_OK(exl_session_eval(s, &best, 1, NULL, logits));
    }
    check_same(alone[5].ids, alone[5].n_ids, next, 20, "generator vs session");
    free(logits);
    exl_session_free(s);
    free(alone);
    free(together);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

EXL_TEST(batch_invariance_tinystories) { check_batch_invariance("tinystories-656k"); }
EXL_TEST(batch_invariance_rand_llama) { check_batch_invariance("rand-llama"); }

/* A seeded sampled job gives the same tokens alone, in a crowd, and under preemption. */
EXL_TEST(seed_determinism_across_batches) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("tinystories-656k", &tok);
    REQUIRE(m);
    enum { N = 6 };
    exl_job_params p[N];
    static const char *texts[N] = {"Once upon a time", "Tom had a red ball",    "The sun",
                                   "A cat and a dog",  "She was happy because", "Lily"};
    for (int i = 0; i < N; i++) {
        p[i] = exl_job_default_params();
        p[i].text = texts[i];
        p[i].sampling.temperature = 1.0f;
        p[i].sampling.top_k = 50;
        p[i].sampling.top_p = 0.95f;
        p[i].sampling.seed = 1000 + (uint64_t)i;
        p[i].max_new_tokens = 40;
        p[i].ignore_eos = 1;
    }
    gu_result *alone = calloc(1, sizeof *alone), *crowd = calloc(N, sizeof *crowd), *tight = calloc(N, sizeof *tight),
              *other = calloc(1, sizeof *other);
    exl_generator *g = gu_generator(m, tok, 0, 0, 0);
    REQUIRE_OK(gu_run(g, &p[0], 1, alone));
    REQUIRE_OK(gu_run(g, p, N, crowd));
    exl_generator_free(g);
    g = gu_generator(m, tok, 6, 16, 0); /* 96 cache slots for 6 jobs of ~45 tokens */
    REQUIRE_OK(gu_run(g, p, N, tight));
    exl_generator_stats st;
    exl_generator_stats_get(g, &st);
    CHECK(st.preemptions > 0);
    exl_generator_free(g);
    check_same(crowd[0].ids, crowd[0].n_ids, alone->ids, alone->n_ids, "seeded job in a crowd");
    for (int i = 0; i < N; i++)
        check_same(tight[i].ids, tight[i].n_ids, crowd[i].ids, crowd[i].n_ids, "seeded job under preemption");
    /* another seed gives another text */
    p[0].sampling.seed = 7;
    g = gu_generator(m, tok, 0, 0, 0);
    REQUIRE_OK(gu_run(g, &p[0], 1, other));
    exl_generator_free(g);
    CHECK(memcmp(other->ids, alone->ids, sizeof alone->ids[0] * 40) != 0);
    free(alone);
    free(crowd);
    free(tight);
    free(other);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

/* ---------------------------------------------------------------- threads, priority */

typedef struct {
    exl_generator *g;
    uint64_t ids[8];
    int ok;
} submitter;

static void *submit_later(void *p) {
    submitter *s = p;
    exl_job_params jp = exl_job_default_params();
    jp.text = "The little dog";
    jp.sampling.temperature = 0;
    jp.max_new_tokens = 8;
    s->ok = 1;
    for (int i = 0; i < 8; i++) {
        usleep(2000);
        s->ok &= exl_generator_submit(s->g, &jp, &s->ids[i]) == EXL_OK;
    }
    return NULL;
}

EXL_TEST(submit_from_another_thread) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("tinystories-656k", &tok);
    REQUIRE(m);
    exl_generator *g = gu_generator(m, tok, 0, 0, 0);
    submitter s = {g, {0}, 0};
    pthread_t th;
    REQUIRE(pthread_create(&th, NULL, submit_later, &s) == 0);
    int finished = 0;
    for (int spins = 0; finished < 8 && spins < 100000; spins++) {
        const exl_gen_event *ev;
        int32_t n;
        REQUIRE_OK(exl_generator_step(g, &ev, &n));
        for (int32_t i = 0; i < n; i++)
            finished += ev[i].finish == EXL_FINISH_LENGTH;
        if (!n)
            usleep(200);
    }
    pthread_join(th, NULL);
    CHECK(s.ok);
    CHECK(finished == 8);
    exl_generator_stats st;
    exl_generator_stats_get(g, &st);
    CHECK(st.jobs_submitted == 8 && st.jobs_finished == 8 && st.jobs_running == 0);
    exl_generator_free(g);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

EXL_TEST(priority_runs_first) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("tinystories-656k", &tok);
    REQUIRE(m);
    exl_generator_params gp = exl_generator_default_params();
    gp.max_jobs = 1;
    exl_generator *g;
    REQUIRE_OK(exl_generator_init(m, tok, &gp, &g));
    exl_job_params p = exl_job_default_params();
    p.text = "Once";
    p.max_new_tokens = 4;
    uint64_t low, high;
    REQUIRE_OK(exl_generator_submit(g, &p, &low));
    p.priority = 5;
    REQUIRE_OK(exl_generator_submit(g, &p, &high));
    uint64_t first_done = 0;
    while (exl_generator_pending(g) > 0) {
        const exl_gen_event *ev;
        int32_t n;
        REQUIRE_OK(exl_generator_step(g, &ev, &n));
        for (int32_t i = 0; i < n; i++)
            if (ev[i].finish && !first_done)
                first_done = ev[i].job;
    }
    CHECK(first_done == high);
    exl_generator_free(g);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

/* ---------------------------------------------------------------- short memory */

/* The greedy tokens of one job, 8 new tokens. */
static int greedy8(exl_model *m, exl_tokenizer *tok, int32_t *out) {
    exl_generator *g = gu_generator(m, tok, 4, 64, 0);
    if (!g)
        return -1;
    static const int32_t prompt[] = {1, 43, 251, 263, 93};
    exl_job_params p = exl_job_default_params();
    p.ids = prompt, p.n_ids = 5, p.max_new_tokens = 8, p.ignore_eos = 1;
    p.sampling.temperature = 0;
    uint64_t id;
    int n = exl_generator_submit(g, &p, &id) == EXL_OK ? 0 : -1;
    while (n >= 0 && exl_generator_pending(g) > 0) {
        const exl_gen_event *ev;
        int32_t k;
        if (exl_generator_step(g, &ev, &k) != EXL_OK) {
            n = -1;
            break;
        }
        for (int32_t e = 0; e < k; e++)
            for (int32_t i = 0; i < ev[e].n_ids && n < 8; i++)
                out[n++] = ev[e].ids[i];
    }
    exl_generator_free(g);
    return n;
}

/* A model whose forward buffers for a full step do not fit loads with smaller steps (one
 * allocation made to fail at every place in turn) and still gives the same tokens. */
EXL_TEST(forward_buffers_fall_back_to_smaller_steps) {
    exl_tokenizer *tok;
    exl_model *ref = gu_load("tinystories-656k", &tok);
    REQUIRE(ref);
    int32_t want[8], got[8];
    REQUIRE(greedy8(ref, tok, want) == 8);
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", exl_test_shared("models/tinystories-656k"));
    exl_model_params mp = exl_model_default_params();
    mp.device = EXL_DEVICE_CPU;
    int smaller = 0, failed = 0;
    for (long n = 0; n < 2000 && smaller + failed < 2000; n++) {
        exl_model *m = NULL;
        exl_alloc_fail_after(n);
        exl_status st = exl_model_load(dir, &mp, &m);
        exl_alloc_fail_after(-1);
        if (st != EXL_OK) {
            CHECK_MSG(st == EXL_ERR_NOMEM && !m, "failing allocation %ld: status %d", n, (int)st);
            failed++;
            continue;
        }
        exl_model_desc d;
        exl_model_describe(m, &d);
        CHECK(d.max_step_tokens == 512 || d.max_step_tokens == 256);
        if (d.max_step_tokens == 256) {
            smaller++;
            CHECK(greedy8(m, tok, got) == 8 && !memcmp(got, want, sizeof want));
        }
        exl_model_free(m);
        if (d.max_step_tokens == 512 && smaller > 0)
            break; /* past the forward buffers: the failure no longer lands in them */
    }
    CHECK(smaller > 0);
    CHECK(failed > 0);
    exl_tokenizer_free(tok);
    exl_model_free(ref);
}

/* ---------------------------------------------------------------- bad arguments */

EXL_TEST(bad_arguments) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("tinystories-656k", &tok);
    REQUIRE(m);
    exl_generator *g = NULL;
    exl_generator_params gp = exl_generator_default_params();
    exl_model_desc d;
    exl_model_describe(m, &d);
    CHECK(d.max_step_tokens == 512); /* the CPU backend's step */
    gp.max_batch_tokens = d.max_step_tokens + 1;
    CHECK(exl_generator_init(m, tok, &gp, &g) == EXL_ERR_ARG && !g);
    CHECK(strstr(exl_last_error(), "1..512") != NULL);
    gp = exl_generator_default_params();
    gp.max_batch_tokens = 100000;
    CHECK(exl_generator_init(m, tok, &gp, &g) == EXL_ERR_ARG && !g);
    gp = exl_generator_default_params();
    gp.max_batch_tokens = 16, gp.max_jobs = 17;
    CHECK(exl_generator_init(m, tok, &gp, &g) == EXL_ERR_ARG && !g);
    gp = exl_generator_default_params(); /* 0, 0: the model's step size, as many jobs */
    CHECK(gp.max_batch_tokens == 0 && gp.max_jobs == 0);
    CHECK(exl_generator_init(m, tok, &gp, &g) == EXL_OK && g);
    exl_generator_free(g);
    g = NULL;
    gp = exl_generator_default_params();
    gp.n_pages = -1;
    CHECK(exl_generator_init(m, tok, &gp, &g) == EXL_ERR_ARG);
    CHECK(exl_generator_init(NULL, tok, NULL, &g) == EXL_ERR_ARG);
    g = gu_generator(m, tok, 2, 16, 0);
    REQUIRE(g);
    uint64_t id;
    int32_t ids[40] = {1, 5000};
    exl_job_params p = exl_job_default_params();
    CHECK(exl_generator_submit(g, &p, &id) == EXL_ERR_ARG); /* no prompt */
    p.ids = ids;
    p.n_ids = 2;
    CHECK(exl_generator_submit(g, &p, &id) == EXL_ERR_ARG); /* token outside the vocabulary */
    ids[1] = 5;
    p.text = "x";
    CHECK(exl_generator_submit(g, &p, &id) == EXL_ERR_ARG); /* both ids and text */
    p.text = NULL;
    CHECK(exl_generator_submit(g, &p, &id) == EXL_ERR_ARG); /* 2 + 256 tokens > 32 slots */
    p.max_new_tokens = 8;
    p.sampling.top_p = 0;
    CHECK(exl_generator_submit(g, &p, &id) == EXL_ERR_ARG);
    p.sampling = exl_sampling_default();
    p.sampling.temperature = -1;
    CHECK(exl_generator_submit(g, &p, &id) == EXL_ERR_ARG);
    p.sampling = exl_sampling_default();
    exl_logit_bias bias = {4096, 1.0f};
    p.sampling.logit_bias = &bias;
    p.sampling.n_logit_bias = 1;
    CHECK(exl_generator_submit(g, &p, &id) == EXL_ERR_ARG);
    p.sampling = exl_sampling_default();
    const char *empty[] = {""};
    p.stop_strings = empty;
    p.n_stop_strings = 1;
    CHECK(exl_generator_submit(g, &p, &id) == EXL_ERR_ARG);
    p.n_stop_strings = 0;
    p.top_logprobs = 99;
    CHECK(exl_generator_submit(g, &p, &id) == EXL_ERR_ARG);
    p.top_logprobs = 0;
    CHECK(strlen(exl_last_error()) > 0);
    CHECK(exl_generator_submit(g, &p, &id) == EXL_OK && id != 0);
    CHECK(exl_generator_cancel(g, id + 100) == EXL_ERR_ARG);
    CHECK(exl_generator_pending(g) == 1);
    exl_generator_free(g); /* with a job still queued */
    exl_tokenizer_free(tok);
    exl_model_free(m);
}

/* ---------------------------------------------------------------- allocation failures */

/* Fail each allocation of init, submit and the steps in turn: every call reports
 * EXL_ERR_NOMEM or goes on, nothing crashes or leaks (under ASan), and jobs still end. */
EXL_TEST(allocation_failures) {
    exl_tokenizer *tok;
    exl_model *m = gu_load("tinystories-656k", &tok);
    REQUIRE(m);
    const char *stops[] = {"zebra"}, *bans[] = {"Lily"};
    exl_job_params p = exl_job_default_params();
    p.text = "Once upon a time";
    p.max_new_tokens = 12;
    p.sampling.temperature = 0;
    p.stop_strings = stops;
    p.n_stop_strings = 1;
    p.banned_strings = bans;
    p.n_banned_strings = 1;
    p.logprobs = 1;
    p.top_logprobs = 2;
    int completed = 0;
    for (long n = 0; n < 400; n++) {
        exl_generator_params gp = exl_generator_default_params();
        gp.n_pages = 4;
        gp.page_size = 8;
        exl_generator *g = NULL;
        exl_alloc_fail_after(n);
        exl_status st = exl_generator_init(m, tok, &gp, &g);
        uint64_t id;
        if (st == EXL_OK)
            st = exl_generator_submit(g, &p, &id);
        int done = 0;
        for (int s = 0; st != EXL_ERR_ARG && g && s < 200 && exl_generator_pending(g) > 0; s++) {
            const exl_gen_event *ev;
            int32_t k;
            st = exl_generator_step(g, &ev, &k);
            CHECK(st == EXL_OK || st == EXL_ERR_NOMEM);
            for (int32_t e = 0; e < k; e++)
                done += ev[e].finish != EXL_FINISH_NONE;
        }
        exl_alloc_fail_after(-1);
        CHECK_MSG(!g || exl_generator_pending(g) == 0, "failing allocation %ld: the job never ended", n);
        completed += done;
        exl_generator_free(g);
    }
    CHECK(completed > 0);
    exl_tokenizer_free(tok);
    exl_model_free(m);
}
