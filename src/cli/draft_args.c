/* draft_args.c - the speculative decoding options that exl run, exl chat and exl serve share: the draft model or
 * n-gram drafting, and the tokens drafted per step. */
#include "cli.h"
#include "options.h"

#include <stddef.h>

#define DEFAULT_DRAFT_TOKENS 4

cli_group cli_draft_group(cli_draft_args *a) {
    *a = (cli_draft_args){0};
    const cli_option options[] = {
        {NULL, "--draft-model", CLI_STRING, &a->model_dir, "DIR", .default_text = "none",
         .help = "speculative decoding: a smaller model with the same\ntokenizer proposes tokens that the model "
                 "checks in one\nstep (the output is the same as without it)"},
        {NULL, "--draft-tokens", CLI_INT, &a->tokens, "K", .lo = 1, .hi = EXL_MAX_DRAFT_TOKENS, .default_text = "4",
         .help = "the most tokens proposed per step (fewer while few\nare accepted)"},
        {NULL, "--draft-fixed", CLI_FLAG, &a->fixed, NULL,
         .help = "propose K tokens every step, however many are\naccepted (for measurements)"},
        {NULL, "--ngram", CLI_INT, &a->ngram, "N", .lo = 1, .hi = 64, .default_text = "off",
         .help = "propose what followed the latest earlier occurrence\nof the last N tokens (prompt lookup), "
                 "before asking\nthe draft model"},
    };
    _Static_assert(sizeof options == sizeof a->options, "cli_draft_args.options holds the group");
    for (size_t i = 0; i < sizeof options / sizeof options[0]; i++)
        a->options[i] = options[i];
    return (cli_group){"speculative decoding", a->options, (int)(sizeof options / sizeof options[0])};
}

int cli_draft_get(cli_draft_args *a, const char *cmd) {
    if (a->tokens && !a->model_dir && !a->ngram)
        return cli_usage_error(cmd, "--draft-tokens needs --draft-model or --ngram");
    if ((a->model_dir || a->ngram) && !a->tokens)
        a->tokens = DEFAULT_DRAFT_TOKENS;
    return CLI_GO_ON;
}

exl_status cli_draft_apply(const cli_draft_args *a, const exl_model_params *params, exl_model **draft,
                           exl_generator_params *gp) {
    *draft = NULL;
    if (a->model_dir) {
        exl_status st = exl_model_load(a->model_dir, params, draft);
        if (st != EXL_OK)
            return st;
    }
    gp->draft_model = *draft;
    gp->draft_tokens = a->tokens;
    gp->ngram = a->ngram;
    gp->draft_fixed = a->fixed;
    return EXL_OK;
}
