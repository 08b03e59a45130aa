/* cmd_chat.c - `exl chat`: an interactive chat in the terminal. Each turn renders the
 * whole conversation as a prompt (exl_chat_encode: the model's chat template) and streams the
 * reply; the generator's prefix cache makes re-reading the history cheap. Reads lines
 * from stdin, so it works on a pipe as well (then without the "> " prompt). Ctrl-C
 * stops a reply; the oldest turns are dropped when the history outgrows the context. */
#include "cli.h"
#include "options.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define DEFAULT_CTX_CAP 4096

static volatile sig_atomic_t interrupted;

static void on_sigint(int sig) { interrupted = 1; }

static const char ABOUT[] =
    "Chat with the model: type a message, the reply streams back. Commands:\n"
    "  /reset        forget the conversation (the system prompt stays)\n"
    "  /system TEXT  set the system prompt (and reset)\n"
    "  /help         this list\n"
    "  /exit         quit (so does end of input)\n"
    "Ctrl-C stops a reply. Lines come from stdin, which need not be a terminal. The prompt is the\n"
    "conversation in the model's chat template (else ChatML), as the server's chat completions make it.";

/* ---------------------------------------------------------------- the conversation */

typedef struct chat {
    exl_model *model;
    exl_tokenizer *tok;
    exl_generator *gen;
    exl_job_params jp;
    int32_t ctx, max_reply;
    char *system;
    exl_chat_message *msgs; /* msgs[0] is the system prompt when there is one */
    char **texts;           /* the messages' contents, owned here */
    int32_t n_msgs, cap_msgs;
    int tty;
} chat;

static void forget(chat *c, int32_t from, int32_t count) {
    if (!count)
        return;
    for (int32_t i = from; i < from + count; i++)
        free(c->texts[i]);
    memmove(c->msgs + from, c->msgs + from + count, (size_t)(c->n_msgs - from - count) * sizeof *c->msgs);
    memmove(c->texts + from, c->texts + from + count, (size_t)(c->n_msgs - from - count) * sizeof *c->texts);
    c->n_msgs -= count;
}

static int add_message(chat *c, const char *role, const char *text, size_t len);

static int reset(chat *c) {
    forget(c, 0, c->n_msgs);
    return c->system && *c->system ? add_message(c, "system", c->system, strlen(c->system)) : 0;
}

static int add_message(chat *c, const char *role, const char *text, size_t len) {
    if (c->n_msgs == c->cap_msgs) {
        int32_t cap = c->cap_msgs ? 2 * c->cap_msgs : 16;
        exl_chat_message *m = realloc(c->msgs, (size_t)cap * sizeof *m);
        if (m)
            c->msgs = m;
        char **t = m ? realloc(c->texts, (size_t)cap * sizeof *t) : NULL;
        if (!t)
            return -1;
        c->texts = t;
        c->cap_msgs = cap;
    }
    char *s = strndup(text, len);
    if (!s)
        return -1;
    c->texts[c->n_msgs] = s;
    c->msgs[c->n_msgs++] = (exl_chat_message){.role = role, .content = s};
    return 0;
}

/* The conversation as a prompt (exl_chat_encode), dropping the oldest turns until it leaves
 * room for a reply of at least a quarter of the window. *too_long: the last message alone is. */
static exl_status render(chat *c, exl_chat_prompt *p, int *too_long) {
    int32_t first = c->n_msgs && !strcmp(c->msgs[0].role, "system");
    for (;;) {
        exl_status st = exl_chat_encode(c->tok, c->msgs, c->n_msgs, 1, NULL, p);
        if (st != EXL_OK)
            return st;
        if (p->n_ids + c->ctx / 4 <= c->ctx || c->n_msgs - first <= 1) {
            *too_long = p->n_ids >= c->ctx;
            return EXL_OK;
        }
        exl_chat_prompt_free(p);
        forget(c, first, c->n_msgs - first >= 3 ? 2 : 1); /* the oldest user + assistant turn */
    }
}

/* Generate and stream one reply; it joins the history. */
static exl_status reply(chat *c) {
    exl_chat_prompt p;
    int too_long = 0;
    exl_status st = render(c, &p, &too_long);
    if (st == EXL_OK && too_long) {
        exl_chat_prompt_free(&p);
        fprintf(stderr, "exl chat: that message is too long for the %d-token window\n", (int)c->ctx);
        forget(c, c->n_msgs - 1, 1);
        return EXL_OK;
    }
    if (st != EXL_OK)
        return st;
    exl_job_params jp = c->jp;
    jp.ids = p.ids;
    jp.n_ids = p.n_ids;
    jp.max_new_tokens = c->ctx - p.n_ids < c->max_reply ? c->ctx - p.n_ids : c->max_reply;
    jp.stop_strings = &p.stop_string;
    jp.n_stop_strings = p.stop_string != NULL;
    jp.stop_ids = &p.stop_id;
    jp.n_stop_ids = p.stop_id >= 0;
    uint64_t job;
    st = exl_generator_submit(c->gen, &jp, &job);
    exl_chat_prompt_free(&p);
    char *text = NULL;
    size_t len = 0;
    int cancelled = 0;
    interrupted = 0;
    while (st == EXL_OK && exl_generator_pending(c->gen) > 0) {
        if (interrupted && !cancelled)
            cancelled = exl_generator_cancel(c->gen, job) == EXL_OK;
        const exl_gen_event *ev;
        int32_t n_ev;
        st = exl_generator_step(c->gen, &ev, &n_ev);
        for (int32_t i = 0; st == EXL_OK && i < n_ev; i++) {
            fwrite(ev[i].text, 1, ev[i].text_len, stdout);
            fflush(stdout);
            char *t = realloc(text, len + ev[i].text_len + 1);
            if (!t) {
                st = EXL_ERR_NOMEM;
                break;
            }
            text = t;
            memcpy(text + len, ev[i].text, ev[i].text_len);
            len += ev[i].text_len;
            text[len] = 0;
        }
    }
    printf(cancelled ? " [stopped]\n" : "\n");
    if (st == EXL_OK && add_message(c, "assistant", text ? text : "", len))
        st = EXL_ERR_NOMEM;
    free(text);
    return st;
}

/* ---------------------------------------------------------------- commands and the loop */

/* 1 to quit, 0 to go on, -1 out of memory. */
static int command(chat *c, char *line) {
    if (!strcmp(line, "/exit") || !strcmp(line, "/quit"))
        return 1;
    if (!strcmp(line, "/reset")) {
        if (reset(c))
            return -1;
        printf("(conversation cleared)\n");
    } else if (!strncmp(line, "/system", 7) && (!line[7] || line[7] == ' ')) {
        free(c->system);
        c->system = strdup(line[7] ? line + 8 : "");
        if (!c->system || reset(c))
            return -1;
        printf("(system prompt set, conversation cleared)\n");
    } else if (!strcmp(line, "/help")) {
        printf("/reset  /system TEXT  /help  /exit  (Ctrl-C stops a reply)\n");
    } else {
        printf("unknown command %s (try /help)\n", line);
    }
    return 0;
}

static exl_status loop(chat *c) {
    char *line = NULL;
    size_t cap = 0;
    exl_status st = EXL_OK;
    for (;;) {
        if (c->tty) {
            printf("> ");
            fflush(stdout);
        }
        errno = 0;
        ssize_t got = getline(&line, &cap, stdin);
        if (got < 0)
            break; /* end of input, or Ctrl-C at the prompt */
        while (got > 0 && (line[got - 1] == '\n' || line[got - 1] == '\r'))
            line[--got] = 0;
        if (got == 0)
            continue;
        if (line[0] == '/') {
            int rc = command(c, line);
            if (rc < 0)
                st = EXL_ERR_NOMEM;
            if (rc)
                break;
            continue;
        }
        if (add_message(c, "user", line, (size_t)got)) {
            st = EXL_ERR_NOMEM;
            break;
        }
        st = reply(c);
        if (st != EXL_OK)
            break;
    }
    if (c->tty && st == EXL_OK)
        printf("\n");
    free(line);
    return st;
}

int cmd_chat(int argc, char **argv) {
    chat c = {.max_reply = 512, .tty = isatty(0)};
    cli_model_args model;
    cli_sampling_args sampling;
    cli_cache_args cache;
    cli_draft_args draft;
    exl_model *draft_model = NULL;
    const char *system = NULL;
    const cli_option options[] = {
        {NULL, "--system", CLI_STRING, &system, "TEXT", .help = "system prompt"},
        {"-n", NULL, CLI_INT, &c.max_reply, "N", .help = "longest reply in tokens", .lo = 1, .hi = 1 << 24},
        {NULL, "--ctx", CLI_INT, &c.ctx, "N", .help = "conversation window in tokens", .lo = 8, .hi = 1 << 24,
         .default_text = "the model's, at most 4096"},
    };
    const cli_command cmd = {"chat",
                             "-m DIR [options]",
                             ABOUT,
                             NULL,
                             {CLI_GROUP("options", options), cli_model_group(&model, CLI_MODEL_ALL | CLI_MODEL_LORA),
                              cli_sampling_group(&sampling),
                              cli_cache_group(&cache, CLI_CACHE_BITS | CLI_CACHE_TOKENS, "the window's"),
                              cli_draft_group(&draft)}};
    int rc = cli_parse(&cmd, argc, argv);
    if (rc == CLI_GO_ON)
        rc = cli_cache_get(&cache, "chat");
    if (rc == CLI_GO_ON)
        rc = cli_draft_get(&draft, "chat");
    if (rc != CLI_GO_ON)
        return rc;
    const char *dir = model.dir;
    c.jp = exl_job_default_params();
    c.jp.sampling = cli_sampling_get(&sampling);

    exl_status st = cli_model_load(&model, &c.model);
    if (st == EXL_OK)
        st = exl_tokenizer_load(dir, &c.tok);
    if (st == EXL_OK) {
        exl_model_desc d;
        exl_model_describe(c.model, &d);
        if (!c.ctx)
            c.ctx = d.max_position_embeddings > 0 && d.max_position_embeddings < DEFAULT_CTX_CAP
                        ? d.max_position_embeddings
                        : DEFAULT_CTX_CAP;
        exl_generator_params gp = exl_generator_default_params();
        gp.max_jobs = 1;
        gp.n_pages = (c.ctx + gp.page_size - 1) / gp.page_size + 1;
        cli_cache_apply(&cache, &gp);
        if ((int64_t)gp.n_pages * gp.page_size < c.ctx) {
            fprintf(stderr, "exl chat: a kv cache of %lld tokens cannot hold the %d-token window (--ctx)\n",
                    (long long)gp.n_pages * gp.page_size, (int)c.ctx);
            exl_tokenizer_free(c.tok);
            exl_model_free(c.model);
            return 1;
        }
        st = cli_draft_apply(&draft, &model.params, &draft_model, &gp);
        if (st == EXL_OK)
            st = exl_generator_init(c.model, c.tok, &gp, &c.gen);
    }
    if (st == EXL_OK && system && !(c.system = strdup(system)))
        st = EXL_ERR_NOMEM;
    if (st == EXL_OK) {
        struct sigaction sa = {.sa_handler = on_sigint}; /* no SA_RESTART: Ctrl-C ends a read */
        sigaction(SIGINT, &sa, NULL);
        if (reset(&c))
            st = EXL_ERR_NOMEM;
        if (st == EXL_OK && c.tty)
            fprintf(stderr, "exl chat: %s (/help for commands)\n", dir);
        if (st == EXL_OK)
            st = loop(&c);
    }
    forget(&c, 0, c.n_msgs);
    free(c.msgs);
    free(c.texts);
    free(c.system);
    exl_generator_free(c.gen);
    exl_tokenizer_free(c.tok);
    exl_model_free(draft_model);
    exl_model_free(c.model);
    return st == EXL_OK ? 0 : cli_error(st);
}
