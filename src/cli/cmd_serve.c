/* cmd_serve.c - `exl serve`: the OpenAI-compatible HTTP server (src/server/server.h)
 * in the foreground until SIGINT or SIGTERM, then a graceful drain and exit status 0;
 * request lines go to stderr. */
#include "cli.h"
#include "options.h"
#include "server/server.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

static const char ABOUT[] =
    "Serve the model over an OpenAI-compatible HTTP API until interrupted:\n"
    "  POST /v1/completions, POST /v1/chat/completions (\"stream\": true for SSE),\n"
    "  GET /v1/models, POST /tokenize, POST /detokenize; GET /health and GET /metrics (Prometheus)\n"
    "  need no API key.\n"
    "Chat prompts use the model's chat template, else ChatML (as exl chat). Sampling fields a request\n"
    "leaves out take the library's defaults (exl_sampling_default, as exl run's --help shows).\n"
    "usage.completion_tokens counts the stop token that ends a completion (as exl run does).\n"
    "The KV cache holds --cache-tokens, or what fits in memory: on a GPU, --gpu-memory of it less what\n"
    "is in use and a 512 MiB margin; on the CPU, what --max-jobs sequences of --ctx tokens can use, at\n"
    "most a quarter of the RAM the weights leave and 4 GiB.\n"
    "Jobs take its pages as they grow and wait when none is left; its size is printed at start.\n"
    "With --draft-model or --ngram, requests decode speculatively unless they set \"speculative\": false.";

/* Every connection is a file descriptor: raise the soft limit as far as allowed, and refuse a
 * --max-connections the process could not hold. */
static int fit_descriptors(int32_t max_connections) {
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl))
        return 0;
    rl.rlim_cur = rl.rlim_max;
    setrlimit(RLIMIT_NOFILE, &rl);
    getrlimit(RLIMIT_NOFILE, &rl);
    if (rl.rlim_cur == RLIM_INFINITY || (rlim_t)max_connections + 64 <= rl.rlim_cur)
        return 0;
    fprintf(stderr, "exl serve: --max-connections %d needs %d file descriptors, the limit is %llu (ulimit -n)\n",
            (int)max_connections, (int)max_connections + 64, (unsigned long long)rl.rlim_cur);
    return -1;
}

static void log_line(void *ctx, const char *line) {
    time_t t = time(NULL);
    struct tm tm;
    char when[32];
    strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", localtime_r(&t, &tm));
    fprintf(stderr, "%s %s\n", when, line);
}

int cmd_serve(int argc, char **argv) {
    exl_server_params sp = exl_server_default_params();
    cli_model_args model;
    cli_cache_args cache;
    cli_draft_args draft;
    int quiet = 0;
    cli_list lora_modules = {0};
    long max_body = (long)sp.max_body, max_response_tokens = (long)sp.max_response_tokens;
    const cli_option options[] = {
        {NULL, "--host", CLI_STRING, &sp.host, "ADDR", .help = "address to listen on"},
        {NULL, "--port", CLI_INT, &sp.port, "N", .help = "TCP port; 0 = any free port, printed at start", .lo = 0,
         .hi = 65535},
        {NULL, "--api-key", CLI_STRING, &sp.api_key, "KEY",
         .help = "require 'Authorization: Bearer KEY' on all but /health and /metrics"},
        {NULL, "--model-name", CLI_STRING, &sp.model_name, "NAME", .help = "the model id clients use",
         .default_text = "the directory's name"},
        {NULL, "--max-jobs", CLI_INT, &sp.max_jobs, "N", .lo = 1, .hi = 256,
         .help = "sequences decoded at once, more wait (a limit: the cache\nis not reserved for them)"},
        {NULL, "--ctx", CLI_INT, &sp.ctx, "N", .lo = 2, .hi = 1 << 24,
         .help = "tokens per sequence, prompt + completion", .default_text = "the model's maximum, at most 4096"},
        {NULL, "--max-body", CLI_LONG, &max_body, "BYTES", .help = "largest request body", .lo = 1, .hi = 1L << 30},
        {NULL, "--max-response-tokens", CLI_LONG, &max_response_tokens, "N", .lo = 1, .hi = 1L << 40,
         .help =
             "refuse a request that may make more than N entries:\nchoices x max_tokens x (1 + logprob entries per token)"},
        {NULL, "--cors-origin", CLI_STRING, &sp.cors_origin, "ORIGIN",
         .help = "let browser pages from ORIGIN call the API\n(\"*\", or a comma-separated list of origins)",
         .default_text = "no CORS headers"},
        {NULL, "--quiet", CLI_FLAG, &quiet, NULL, .help = "do not log requests"},
        {NULL, "--lora-modules", CLI_LIST_REST, &lora_modules, "NAME=DIR[:SCALE]", .default_text = "",
         .help = "PEFT LoRA adapters a request selects with \"model\": NAME\n(listed by /v1/models)"},
        {NULL, "--admin-key", CLI_STRING, &sp.admin_key, "KEY",
         .help = "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter\nwith 'Authorization: Bearer KEY'",
         .default_text = "those refuse"},
    };
    const cli_option connections[] = {
        {NULL, "--max-connections", CLI_INT, &sp.max_connections, "N", .lo = 1, .hi = 1 << 20,
         .help = "open connections in all; more are refused (503)"},
        {NULL, "--max-client-connections", CLI_INT, &sp.max_client_connections, "N", .lo = 0, .hi = 1 << 20,
         .help = "open connections per client address; more are refused (429); 0 = no cap"},
        {NULL, "--request-timeout", CLI_INT, &sp.request_timeout_s, "SECONDS", .lo = 1, .hi = 86400,
         .help = "a request's head and body must arrive within this\nof its first byte (408)"},
        {NULL, "--idle-timeout", CLI_INT, &sp.idle_timeout_s, "SECONDS", .lo = 1, .hi = 86400,
         .help = "close keep-alive connections idle this long,\nand clients that stop reading an answer"},
        {NULL, "--drain-timeout", CLI_INT, &sp.drain_timeout_s, "SECONDS", .lo = 0, .hi = 86400,
         .help = "on SIGTERM/SIGINT: how long requests in progress may\nfinish before they are cancelled"},
        {NULL, "--http-threads", CLI_INT, &sp.http_workers, "N", .lo = 1, .hi = 256,
         .help = "threads that parse requests and format answers"},
    };
    const cli_command cmd = {
        "serve",
        "-m DIR [options]",
        ABOUT,
        NULL,
        {CLI_GROUP("options", options), CLI_GROUP("connections", connections), cli_model_group(&model, CLI_MODEL_ALL),
         cli_cache_group(&cache, CLI_CACHE_BITS | CLI_CACHE_TOKENS | CLI_CACHE_MEMORY, "what fits in memory"),
         cli_draft_group(&draft)}};
    model.params.device = sp.device;
    model.params.n_threads = sp.n_threads;
    int rc = cli_parse(&cmd, argc, argv);
    if (rc == CLI_GO_ON)
        rc = cli_cache_get(&cache, "serve");
    if (rc == CLI_GO_ON)
        rc = cli_draft_get(&draft, "serve");
    if (rc != CLI_GO_ON)
        return rc;
    sp.cache_tokens = cache.tokens;
    sp.gpu_memory = cache.gpu_memory;
    sp.cache_k_bits = cache.k_bits, sp.cache_v_bits = cache.v_bits;
    sp.model_dir = model.dir;
    sp.draft_model_dir = draft.model_dir;
    sp.draft_tokens = draft.tokens;
    sp.ngram = draft.ngram;
    sp.draft_fixed = draft.fixed;
    sp.max_body = max_body;
    sp.max_response_tokens = max_response_tokens;
    sp.device = model.params.device;
    sp.n_threads = model.params.n_threads;
    sp.lora_modules = lora_modules.items;
    sp.n_lora_modules = lora_modules.n;
    if (!quiet)
        sp.log = log_line;

    /* every thread started from here on inherits the blocked set; this one waits */
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop, NULL);
    signal(SIGPIPE, SIG_IGN);
    if (fit_descriptors(sp.max_connections)) {
        cli_list_free(&lora_modules);
        return 1;
    }

    exl_server *srv;
    exl_status st = exl_server_start(&sp, &srv);
    cli_list_free(&lora_modules); /* loaded or failed: the server keeps no pointer to them */
    if (st != EXL_OK)
        return cli_error(st);
    exl_server_cache kv;
    exl_server_cache_info(srv, &kv);
    fprintf(stderr, "exl serve: kv cache of %lld tokens (%lld pages of %d), keys %d-bit, values %d-bit, %.1f MiB\n",
            (long long)kv.tokens, (long long)(kv.tokens / kv.page_size), (int)kv.page_size, (int)kv.k_bits,
            (int)kv.v_bits, kv.bytes / 1048576.0);
    int v6 = strchr(sp.host, ':') != NULL; /* an IPv6 address goes in brackets */
    fprintf(stderr, "exl serve: model %s at http://%s%s%s:%d/v1 (Ctrl-C to stop)\n", exl_server_model_name(srv),
            v6 ? "[" : "", sp.host, v6 ? "]" : "", (int)exl_server_port(srv));
    int sig = 0;
    sigwait(&stop, &sig);
    fprintf(stderr, "exl serve: %s, draining (at most %d s), then stopping\n",
            sig == SIGINT ? "interrupted" : "terminated", (int)sp.drain_timeout_s);
    exl_server_stop(srv);
    fprintf(stderr, "exl serve: stopped\n");
    return 0;
}
