/* cmd_serve.c - `exl serve`: the OpenAI-compatible HTTP server (src/server/server.h)
 * in the foreground until SIGINT or SIGTERM; request lines go to stderr. */
#include "cli.h"
#include "server/server.h"

#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

static void help(void) {
    printf("usage: exl serve -m DIR [options]\n\n"
           "Serve the model over an OpenAI-compatible HTTP API until interrupted:\n"
           "  POST /v1/completions, POST /v1/chat/completions (\"stream\": true for SSE),\n"
           "  GET /v1/models, GET /health.\n"
           "Chat prompts use the model's chat template, else ChatML.\n\n"
           "options:\n"
           "  --host ADDR          address to listen on (default 127.0.0.1)\n"
           "  --port N             TCP port (default 8000; 0 = any free port, printed at start)\n"
           "  --api-key KEY        require 'Authorization: Bearer KEY' on /v1/ routes\n"
           "  --model-name NAME    the model id clients use (default: the directory's name)\n"
           "  --max-jobs N         sequences decoded at once, more wait (default 32)\n"
           "  --ctx N              tokens per sequence, prompt + completion\n"
           "                       (default: the model's maximum, at most 4096)\n"
           "  --max-body BYTES     largest request body (default 4194304)\n"
           "  --quiet              do not log requests\n"
           "  --device cpu|cuda|auto, -t THREADS\n");
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
    int quiet = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        long x;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            help();
            return 0;
        } else if (!strcmp(a, "--quiet")) {
            quiet = 1;
        } else if (!v) {
            return cli_usage_error("serve", "unknown option or missing value '%s'", a);
        } else if (!strcmp(a, "-m") || !strcmp(a, "--model")) {
            sp.model_dir = argv[++i];
        } else if (!strcmp(a, "--host")) {
            sp.host = argv[++i];
        } else if (!strcmp(a, "--api-key")) {
            sp.api_key = argv[++i];
        } else if (!strcmp(a, "--model-name")) {
            sp.model_name = argv[++i];
        } else if (!strcmp(a, "--port")) {
            if (cli_parse_int(argv[++i], 0, 65535, &x))
                return cli_usage_error("serve", "bad port '%s'", v);
            sp.port = (int32_t)x;
        } else if (!strcmp(a, "--max-jobs")) {
            if (cli_parse_int(argv[++i], 1, 256, &x))
                return cli_usage_error("serve", "bad --max-jobs '%s' (1..256)", v);
            sp.max_jobs = (int32_t)x;
        } else if (!strcmp(a, "--ctx")) {
            if (cli_parse_int(argv[++i], 2, 1 << 24, &x))
                return cli_usage_error("serve", "bad --ctx '%s'", v);
            sp.ctx = (int32_t)x;
        } else if (!strcmp(a, "--max-body")) {
            if (cli_parse_int(argv[++i], 1, 1L << 30, &x))
                return cli_usage_error("serve", "bad --max-body '%s'", v);
            sp.max_body = x;
        } else if (!strcmp(a, "--device")) {
            if (cli_parse_device(argv[++i], &sp.device))
                return cli_usage_error("serve", "unknown device '%s'", v);
        } else if (!strcmp(a, "-t") || !strcmp(a, "--threads")) {
            if (cli_parse_int(argv[++i], 1, 1024, &x))
                return cli_usage_error("serve", "bad thread count '%s'", v);
            sp.n_threads = (int32_t)x;
        } else {
            return cli_usage_error("serve", "unknown option '%s'", a);
        }
    }
    if (!sp.model_dir)
        return cli_usage_error("serve", "need -m DIR");
    if (!quiet)
        sp.log = log_line;

    /* every thread started from here on inherits the blocked set; this one waits */
    sigset_t stop;
    sigemptyset(&stop);
    sigaddset(&stop, SIGINT);
    sigaddset(&stop, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &stop, NULL);
    signal(SIGPIPE, SIG_IGN);

    exl_server *srv;
    exl_status st = exl_server_start(&sp, &srv);
    if (st != EXL_OK)
        return cli_error(st);
    fprintf(stderr, "exl serve: model %s at http://%s:%d/v1 (Ctrl-C to stop)\n", exl_server_model_name(srv),
            sp.host, (int)exl_server_port(srv));
    int sig = 0;
    sigwait(&stop, &sig);
    fprintf(stderr, "exl serve: %s, stopping\n", sig == SIGINT ? "interrupted" : "terminated");
    exl_server_stop(srv);
    return 0;
}
