/* generator.c - the generator's public face: defaults, init/free, and the calls other
 * threads make (submit, cancel, pending, stats), which touch only the mutex-guarded
 * inbox. Stepping is in step.c, scheduling in scheduler.c. */
#include "generator/generator.h"

#include "base/alloc.h"
#include "base/error.h"
#include "io/json_file.h"

#include <string.h>

#define DEFAULT_PAGES 64
#define DEFAULT_PAGE_SIZE 256
#define MAX_PAGE_SIZE 65536

/* ---------------------------------------------------------------- defaults */

exl_generator_params exl_generator_default_params(void) {
    return (exl_generator_params){.n_pages = DEFAULT_PAGES,
                                  .page_size = DEFAULT_PAGE_SIZE,
                                  .prefix_cache = 1,
                                  .cache_k_bits = 16,
                                  .cache_v_bits = 16};
}

exl_sampling exl_sampling_default(void) {
    return (exl_sampling){.temperature = 1.0f,
                          .top_p = 1.0f,
                          .typical_p = 1.0f,
                          .tfs_z = 1.0f,
                          .mirostat_tau = 5.0f,
                          .mirostat_eta = 0.1f,
                          .repetition_penalty = 1.0f};
}

exl_job_params exl_job_default_params(void) {
    return (exl_job_params){.add_special = 1, .max_new_tokens = 256, .sampling = exl_sampling_default()};
}

const char *exl_finish_reason_str(exl_finish_reason r) {
    switch (r) {
    case EXL_FINISH_NONE: return "none";
    case EXL_FINISH_STOP: return "stop";
    case EXL_FINISH_LENGTH: return "length";
    case EXL_FINISH_CANCELLED: return "cancelled";
    case EXL_FINISH_ERROR: return "error";
    }
    return "unknown";
}

/* ---------------------------------------------------------------- init / free */

static void add_eos(exl_generator *g, int32_t id) {
    if (id < 0 || id >= g->vocab || g->n_eos == (int32_t)(sizeof g->eos / sizeof g->eos[0]))
        return;
    for (int32_t i = 0; i < g->n_eos; i++)
        if (g->eos[i] == id)
            return;
    g->eos[g->n_eos++] = id;
}

/* eos ids of config.json, generation_config.json (optional) and the tokenizer. */
static exl_status collect_eos(exl_generator *g) {
    for (int32_t i = 0; i < g->model->cfg.n_eos; i++)
        add_eos(g, g->model->cfg.eos_token_ids[i]);
    add_eos(g, exl_tokenizer_eos_id(g->tok));
    char *path = exl_path_join(g->model->dir, "generation_config.json");
    if (!path)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    cJSON *root = NULL;
    exl_status st = exl_file_exists(path) ? exl_json_read_file(path, &root) : EXL_OK;
    const cJSON *eos = root ? cJSON_GetObjectItemCaseSensitive(root, "eos_token_id") : NULL;
    if (cJSON_IsNumber(eos))
        add_eos(g, (int32_t)eos->valuedouble);
    for (const cJSON *e = cJSON_IsArray(eos) ? eos->child : NULL; e; e = e->next)
        if (cJSON_IsNumber(e))
            add_eos(g, (int32_t)e->valuedouble);
    cJSON_Delete(root);
    exl_free(path);
    return st;
}

static exl_status check_params(const exl_generator_params *p, int32_t max_rows) {
    if (p->n_pages < 1 || p->page_size < 1 || p->page_size > MAX_PAGE_SIZE)
        return exl_fail(EXL_ERR_ARG, "generator: need n_pages >= 0 and page_size in 1..%d", MAX_PAGE_SIZE);
    if ((int64_t)p->n_pages * p->page_size > INT32_MAX)
        return exl_fail(EXL_ERR_ARG, "generator: %d pages of %d tokens is too large", p->n_pages, p->page_size);
    if (p->max_batch_tokens < 1 || p->max_batch_tokens > max_rows)
        return exl_fail(EXL_ERR_ARG, "generator: max_batch_tokens must be in 1..%d", max_rows);
    if (p->max_jobs < 1 || p->max_jobs > p->max_batch_tokens)
        return exl_fail(EXL_ERR_ARG, "generator: max_jobs must be in 1..max_batch_tokens (%d)", p->max_batch_tokens);
    return EXL_OK;
}

/* n_pages 0: the pages that fit in memory */
static exl_status fit_pages(exl_model *m, exl_generator_params *p) {
    int64_t tokens;
    EXL_TRY(exl_cache_fit_tokens(m, p->cache_k_bits, p->cache_v_bits, p->memory_fraction, &tokens));
    int64_t pages = tokens / p->page_size;
    if (pages < 1)
        return exl_fail(EXL_ERR_NOMEM, "generator: no memory is left for a kv cache page of %d tokens", p->page_size);
    p->n_pages = pages < INT32_MAX / p->page_size ? (int32_t)pages : INT32_MAX / p->page_size;
    return EXL_OK;
}

exl_status exl_generator_init(exl_model *model, const exl_tokenizer *tok, const exl_generator_params *params,
                              exl_generator **out) {
    if (!out)
        return exl_fail(EXL_ERR_ARG, "exl_generator_init: NULL argument");
    *out = NULL;
    if (!model || !tok)
        return exl_fail(EXL_ERR_ARG, "exl_generator_init: a model and a tokenizer are needed");
    exl_generator_params p = params ? *params : exl_generator_default_params();
    if (p.max_batch_tokens == 0) /* the model's step size */
        p.max_batch_tokens = exl_model_max_rows(model);
    if (p.max_jobs == 0)
        p.max_jobs = p.max_batch_tokens;
    if (p.n_pages == 0 && p.page_size > 0)
        EXL_TRY(fit_pages(model, &p));
    EXL_TRY(check_params(&p, exl_model_max_rows(model)));
    exl_generator *g = exl_calloc(1, sizeof *g);
    if (!g)
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    g->model = model;
    g->tok = tok;
    g->params = p;
    g->vocab = model->cfg.vocab_size;
    exl_gen_ahead_init(g);
    exl_sched_init(g);
    exl_gen_trace_open(g);
    pthread_mutex_init(&g->mu, NULL);
    exl_status st = exl_kv_cache_init(model, p.n_pages, p.page_size, p.cache_k_bits, p.cache_v_bits, &g->cache);
    if (st == EXL_OK)
        st = exl_page_pool_init(&g->pool, p.n_pages, p.page_size);
    if (st == EXL_OK)
        st = exl_sampler_scratch_init(&g->scratch, g->vocab);
    if (st == EXL_OK)
        st = collect_eos(g);
    if (st == EXL_OK) {
        g->steps = exl_malloc((size_t)p.max_jobs * sizeof *g->steps);
        g->step_jobs = exl_malloc((size_t)p.max_jobs * sizeof *g->step_jobs);
        g->step_sets = exl_malloc((size_t)p.max_jobs * sizeof *g->step_sets);
        g->logits = exl_malloc((size_t)p.max_jobs * g->vocab * sizeof *g->logits);
        g->cap_logit_rows = p.max_jobs;
        g->raw = exl_malloc((size_t)g->vocab * sizeof *g->raw);
        g->head_max = exl_model_top_k_max(model);
        g->head_ids = exl_malloc((size_t)p.max_jobs * (g->head_max ? g->head_max : 1) * sizeof *g->head_ids);
        g->head_vals = exl_malloc((size_t)p.max_jobs * (g->head_max ? g->head_max : 1) * sizeof *g->head_vals);
        if (!g->steps || !g->step_jobs || !g->step_sets || !g->logits || !g->raw || !g->head_ids || !g->head_vals)
            st = exl_fail(EXL_ERR_NOMEM, "out of memory");
    }
    if (st == EXL_OK)
        st = exl_spec_init(g);
    if (st == EXL_OK)
        st = exl_gen_warmup(g);
    if (st != EXL_OK) {
        exl_generator_free(g);
        return st;
    }
    *out = g;
    return EXL_OK;
}

static void free_jobs(exl_job_list *l) {
    for (int32_t i = 0; i < l->n; i++)
        exl_job_free(l->v[i]);
    exl_job_list_free(l);
}

void exl_generator_free(exl_generator *g) {
    if (!g)
        return;
    exl_gen_ahead_drop(g);
    exl_gen_trace_close(g);
    exl_spec_free(g);
    free_jobs(&g->inbox);
    free_jobs(&g->waiting);
    free_jobs(&g->running);
    free_jobs(&g->done);
    exl_job_list_free(&g->alive);
    exl_kv_cache_free(g->model, g->cache);
    exl_page_pool_free(&g->pool);
    exl_sampler_scratch_free(&g->scratch);
    exl_gen_dsample_free(g);
    exl_free(g->steps);
    exl_free(g->step_jobs);
    exl_free(g->step_sets);
    exl_free(g->logits);
    exl_free(g->raw);
    exl_free(g->head_ids);
    exl_free(g->head_vals);
    exl_free(g->events);
    exl_free(g->event_jobs);
    exl_token_trie_free(g->trie);
    exl_free(g->masks);
    pthread_mutex_destroy(&g->mu);
    exl_free(g);
}

int exl_gen_reserve_events(exl_generator *g, int32_t n) {
    if (n <= g->cap_events)
        return 0;
    int32_t cap = g->cap_events ? g->cap_events : 16;
    while (cap < n)
        cap *= 2;
    exl_gen_event *e = exl_realloc(g->events, (size_t)cap * sizeof *e);
    if (e)
        g->events = e;
    exl_job **j = e ? exl_realloc(g->event_jobs, (size_t)cap * sizeof *j) : NULL;
    if (!j)
        return -1;
    g->event_jobs = j;
    g->cap_events = cap;
    return 0;
}

/* ---------------------------------------------------------------- calls from any thread */

exl_status exl_generator_submit(exl_generator *g, const exl_job_params *params, uint64_t *job) {
    if (!g || !params || !job)
        return exl_fail(EXL_ERR_ARG, "exl_generator_submit: NULL argument");
    *job = 0;
    exl_job *j;
    EXL_TRY(exl_job_create(g, params, &j));
    j->t_submit = exl_gen_now();
    pthread_mutex_lock(&g->mu);
    exl_status st = EXL_OK;
    if (exl_job_list_reserve(&g->inbox, g->inbox.n + 1) || exl_job_list_reserve(&g->alive, g->alive.n + 1)) {
        st = exl_fail(EXL_ERR_NOMEM, "out of memory");
    } else {
        j->id = j->order = ++g->next_id;
        g->inbox.v[g->inbox.n++] = j;
        g->alive.v[g->alive.n++] = j;
        g->published.jobs_submitted++;
        *job = j->id;
    }
    pthread_mutex_unlock(&g->mu);
    if (st != EXL_OK)
        exl_job_free(j);
    return st;
}

exl_status exl_generator_cancel(exl_generator *g, uint64_t job) {
    if (!g)
        return exl_fail(EXL_ERR_ARG, "exl_generator_cancel: NULL argument");
    int found = 0;
    pthread_mutex_lock(&g->mu);
    for (int32_t i = 0; i < g->alive.n && !found; i++)
        if (g->alive.v[i]->id == job)
            found = g->alive.v[i]->cancel = 1;
    pthread_mutex_unlock(&g->mu);
    return found ? EXL_OK
                 : exl_fail(EXL_ERR_ARG, "generator: no job %llu is waiting or running", (unsigned long long)job);
}

int32_t exl_generator_pending(exl_generator *g) {
    if (!g)
        return 0;
    pthread_mutex_lock(&g->mu);
    int32_t n = g->alive.n;
    pthread_mutex_unlock(&g->mu);
    return n;
}

void exl_generator_stats_get(exl_generator *g, exl_generator_stats *out) {
    if (!g || !out)
        return;
    pthread_mutex_lock(&g->mu);
    *out = g->published;
    out->jobs_waiting += g->inbox.n;
    pthread_mutex_unlock(&g->mu);
}
