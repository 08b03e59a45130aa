/* exl.h - the one public header of libexl, an inference engine for quantized LLMs.
 *
 * Every fallible call returns an exl_status; on failure a one-line message naming
 * the file, tensor or field at fault is kept per thread and read with exl_last_error().
 * Handles are opaque and come in _load/_free or _init/_free pairs. */
#ifndef EXL_H
#define EXL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- version */

#define EXL_VERSION_MAJOR 0
#define EXL_VERSION_MINOR 2
#define EXL_VERSION_PATCH 0
#define EXL_VERSION_JOIN_(a, b, c) #a "." #b "." #c
#define EXL_VERSION_JOIN(a, b, c) EXL_VERSION_JOIN_(a, b, c)
/* "0.2.0" */
#define EXL_VERSION_STRING EXL_VERSION_JOIN(EXL_VERSION_MAJOR, EXL_VERSION_MINOR, EXL_VERSION_PATCH)

/* ---------------------------------------------------------------- status */

typedef enum exl_status {
    EXL_OK = 0,
    EXL_ERR_IO,          /* a file is missing, unreadable or truncated */
    EXL_ERR_FORMAT,      /* a file is readable but its content is malformed */
    EXL_ERR_UNSUPPORTED, /* well-formed but not something exl can run */
    EXL_ERR_NOMEM,       /* an allocation failed (host or device) */
    EXL_ERR_ARG,         /* a caller passed an invalid argument */
    EXL_ERR_DEVICE,      /* the accelerator or its driver failed */
    EXL_ERR_STATE,       /* the call is not valid in the object's current state */
} exl_status;

/* The name of a status code, e.g. "format error". */
const char *exl_status_str(exl_status st);
/* The message of the last failed call on this thread ("" if none). */
const char *exl_last_error(void);

/* ---------------------------------------------------------------- models */

typedef struct exl_model exl_model;

typedef enum exl_device {
    EXL_DEVICE_AUTO = 0, /* GPU when one is usable, else CPU */
    EXL_DEVICE_CPU,
    EXL_DEVICE_CUDA, /* insist on the GPU: failing to get one is an error */
} exl_device;

#define EXL_MAX_GPU_SPLIT 16 /* devices a layer split (exl_model_params.gpu_split) spans at most */

typedef struct exl_model_params {
    exl_device device;
    int32_t n_threads; /* CPU worker threads; 0 = one per core */
    int32_t load_only; /* check and map the weights for exl_model_describe / _report only (`exl info`): also
                          * architectures exl cannot run yet load, and nothing can be evaluated */
    int32_t tp;        /* tensor parallelism: split the model over this many devices (GPUs; CPU ranks share the
                          * cores); 0 or 1 = one device (docs/parallel.md) */
    float gpu_split[EXL_MAX_GPU_SPLIT]; /* layer split: GB of weights each device takes, whole layers in order
                                         * (device k: GPU k, or CPU rank k); all 0 = none. Not with tp > 1 */
} exl_model_params;

exl_model_params exl_model_default_params(void);

/* Load a Hugging Face style model directory (config.json + safetensors). */
exl_status exl_model_load(const char *dir, const exl_model_params *params, exl_model **out);
void exl_model_free(exl_model *model);

typedef struct exl_model_desc {
    char arch[32]; /* config.json's model_type: "llama", "qwen3", "mixtral", ... */
    int32_t vocab_size;
    int32_t hidden_size;
    int32_t intermediate_size;
    int32_t n_layers;
    int32_t n_heads;
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t max_position_embeddings;
    int32_t bos_token_id; /* -1 if none */
    int32_t n_eos_token_ids;
    int32_t eos_token_ids[8];
    int32_t tied_embeddings;
    char backend[16];        /* "cpu" or "cuda" */
    int32_t max_step_tokens; /* tokens one forward step takes (512 on the CPU, 2048 on CUDA) */
    uint64_t decode_bytes;   /* weight bytes read per decoded token (all but the embedding table) */
    uint64_t file_bytes;     /* size of the weight files */
    /* generation_config.json's sampling defaults; < 0 where it sets none */
    int32_t gen_do_sample;
    float gen_temperature, gen_top_p, gen_min_p, gen_repetition_penalty;
    int32_t gen_top_k;
} exl_model_desc;

void exl_model_describe(const exl_model *model, exl_model_desc *out);

/* A human-readable report (architecture, sizes, dtypes per tensor group, every linear layer's
 * format and bits per weight, parameter count, memory needed). The string is owned by the
 * caller; free with exl_string_free. */
exl_status exl_model_report(const exl_model *model, char **out);
/* The same report with the linear layers grouped by kind (self_attn.q_proj, mlp.down_proj, lm_head,
 * ...) instead of one line each: per kind the count, formats, shape, bits-per-weight range, code
 * widths and size. */
exl_status exl_model_report_grouped(const exl_model *model, char **out);
void exl_string_free(char *s);

/* ---------------------------------------------------------------- sessions */

/* A session is one token sequence with its own KV cache on the model's backend. */
typedef struct exl_session exl_session;

exl_status exl_session_init(exl_model *model, int32_t max_tokens, exl_session **out);
/* The same with the cache's keys and values stored in k_bits and v_bits each: 16 (as exl_session_init; 0 too),
 * 8, 6 or 4 (quantized in groups along each head, see exl_cache_token_bytes). */
exl_status exl_session_init_cache(exl_model *model, int32_t max_tokens, int32_t k_bits, int32_t v_bits,
                                  exl_session **out);
void exl_session_free(exl_session *session);
/* Forget all tokens (the cache is kept allocated). */
void exl_session_reset(exl_session *session);
int32_t exl_session_length(const exl_session *session);

/* Append n tokens and run them through the model. If logits is not NULL it receives
 * the fp32 logits of every appended position, n * vocab_size floats, row-major. If
 * last_logits is not NULL it receives only the last position's vocab_size floats. */
exl_status exl_session_eval(exl_session *session, const int32_t *ids, int32_t n, float *logits, float *last_logits);

/* Write one fp32 matrix [rows, cols] as a safetensors file holding a single tensor. */
exl_status exl_tensor_save(const char *path, const char *name, const float *data, int32_t rows, int32_t cols);

/* ---------------------------------------------------------------- LoRA adapters */

/* A PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) loaded for one model: its low-rank factors
 * run beside the targeted linears (never merged into the weights, so quantized models take adapters too). Up to 64
 * adapters per model; each job may use its own weighted set of them, and one forward step mixes jobs with
 * different sets. */
typedef struct exl_lora exl_lora;

/* Load dir for model; errors name the adapter and the tensor or field at fault (another architecture or size,
 * missing tensors, unknown target modules, modules_to_save, DoRA). */
exl_status exl_lora_load(exl_model *model, const char *dir, exl_lora **out);
/* Unload (NULL is a no-op). No job or session may use it any more (the model's set drops it); adapters still
 * loaded are freed with the model. */
void exl_lora_free(exl_lora *lora);

/* One adapter of a set, weighted: the update scale * (x · A^T) · B^T (PEFT's own scaling, alpha / r or
 * alpha / sqrt(r), applied first). */
typedef struct exl_lora_use {
    const exl_lora *lora;
    float scale; /* 1 for the adapter as trained */
} exl_lora_use;

#define EXL_LORA_MAX_USES 8 /* adapters in one set */

/* The set sessions and jobs without one of their own run with (n 0: the base model); copied. */
exl_status exl_model_set_lora(exl_model *model, const exl_lora_use *uses, int32_t n);
/* Generator jobs holding the adapter now (submitted and not yet freed, which happens a step after they end). */
int32_t exl_lora_users(const exl_lora *lora);
/* Load "DIR[:SCALE]" (the command lines' --lora; scale 1 when none is given) into *use. */
exl_status exl_lora_load_spec(exl_model *model, const char *spec, exl_lora_use *use);

/* ---------------------------------------------------------------- tokenizer */

/* Loaded from a model directory: tokenizer.json, else tokenizer.model (SentencePiece),
 * with tokenizer_config.json / special_tokens_map.json for flags and the chat template. */
typedef struct exl_tokenizer exl_tokenizer;

exl_status exl_tokenizer_load(const char *model_dir, exl_tokenizer **out);
void exl_tokenizer_free(exl_tokenizer *tok);
int32_t exl_tokenizer_vocab_size(const exl_tokenizer *tok);
/* The token's text as stored in the vocabulary (NULL if id is out of range). */
const char *exl_tokenizer_token_text(const exl_tokenizer *tok, int32_t id);
/* -1 when the tokenizer defines none. */
int32_t exl_tokenizer_bos_id(const exl_tokenizer *tok);
int32_t exl_tokenizer_eos_id(const exl_tokenizer *tok);
int exl_tokenizer_is_special(const exl_tokenizer *tok, int32_t id);

/* The bytes token id adds to decoded text after other tokens (what exl_detokenizer streams for it
 * in the middle of a text): *len receives their count, of which at most cap are written to buf
 * (call again with more room when *len > cap); -1 when the token never shows in the text (a
 * special token, which decoding skips). */
exl_status exl_tokenizer_token_bytes(const exl_tokenizer *tok, int32_t id, char *buf, int32_t cap, int32_t *len);

/* Encode UTF-8 text as Hugging Face `tokenizer(text, add_special_tokens=add_special)`
 * does: added tokens in the text are always matched; add_special applies the
 * post-processor (BOS/EOS). *ids is allocated; free with exl_ids_free. */
exl_status exl_tokenizer_encode(const exl_tokenizer *tok, const char *text, size_t len, int add_special, int32_t **ids,
                                int32_t *n_ids);
void exl_ids_free(int32_t *ids);
/* Decode like `tokenizer.decode(ids, skip_special_tokens=skip_special)`; free with exl_string_free. */
exl_status exl_tokenizer_decode(const exl_tokenizer *tok, const int32_t *ids, int32_t n, int skip_special, char **text);

/* Streaming decode: push ids one at a time; each push yields the text that is now
 * final (never a partial UTF-8 character). The concatenation of all yields plus
 * exl_detokenizer_flush equals exl_tokenizer_decode of all ids. */
typedef struct exl_detokenizer exl_detokenizer;
exl_status exl_detokenizer_init(const exl_tokenizer *tok, int skip_special, exl_detokenizer **out);
void exl_detokenizer_free(exl_detokenizer *d);
/* *text points into the detokenizer (valid until the next call), *len bytes. */
exl_status exl_detokenizer_push(exl_detokenizer *d, int32_t id, const char **text, size_t *len);
exl_status exl_detokenizer_flush(exl_detokenizer *d, const char **text, size_t *len);

/* ---------------------------------------------------------------- chat templates */

typedef struct exl_chat_message {
    const char *role; /* "system", "user", "assistant", "tool" */
    const char *content;
    const char *tool_calls;   /* assistant: a JSON array of OpenAI tool calls ({"id", "type", "function":
                               * {"name", "arguments"}}), or NULL; templates see each arguments string
                               * parsed into an object */
    const char *tool_call_id; /* tool: the call it answers, or NULL */
    const char *name;         /* tool: the function that answered, or NULL */
} exl_chat_message;

/* Render the model's chat template (tokenizer_config.json `chat_template`, or a
 * documented fallback) as transformers' apply_chat_template(tokenize=False) does.
 * tools_json: a JSON array of tool definitions, or NULL. Free with exl_string_free. */
exl_status exl_chat_apply(const exl_tokenizer *tok, const exl_chat_message *messages, int32_t n_messages,
                          int add_generation_prompt, const char *tools_json, char **text);

/* A conversation as a prompt: the one way exl turns messages into token ids (exl chat and the
 * server both use it). The text of exl_chat_apply is tokenized as written (no post-processor:
 * templates write their own BOS), then the tokenizer's BOS is put first when it has one and the
 * template did not write it. A model without a chat template gets the ChatML fallback, whose end
 * marker "<|im_end|>" must then end the reply: it is returned as stop_string, and as stop_id too
 * when it is one token of the vocabulary (a special token never shows in the text, so only the id
 * can stop on it). With a template both are unset: the model's eos ids end the reply. */
typedef struct exl_chat_prompt {
    int32_t *ids; /* the prompt; free the whole struct with exl_chat_prompt_free */
    int32_t n_ids;
    const char *stop_string; /* a static string, or NULL */
    int32_t stop_id;         /* -1 when none */
} exl_chat_prompt;

exl_status exl_chat_encode(const exl_tokenizer *tok, const exl_chat_message *messages, int32_t n_messages,
                           int add_generation_prompt, const char *tools_json, exl_chat_prompt *out);
void exl_chat_prompt_free(exl_chat_prompt *prompt);

/* ---------------------------------------------------------------- constrained decoding */

/* What a job's output must match, compiled once into an automaton over bytes; each step, the
 * tokens whose bytes would leave it are masked out before sampling, and end-of-sequence tokens are
 * allowed only where the output is complete. A job ends when its output is complete and nothing
 * more can follow. A constraint may be shared by the jobs of one generator (each takes a
 * reference); it is then used by that generator's stepping thread only. */
typedef enum exl_constraint_kind {
    EXL_CONSTRAINT_GBNF,            /* a GBNF grammar (llama.cpp's notation), starting at rule `root` */
    EXL_CONSTRAINT_REGEX,           /* a regular expression the whole output must match */
    EXL_CONSTRAINT_JSON_SCHEMA,     /* a JSON Schema in the subset OpenAI's strict mode accepts; any other
                                     * keyword is an error that names it */
    EXL_CONSTRAINT_JSON_SCHEMA_LAX, /* the same, but keywords outside the subset are ignored */
} exl_constraint_kind;

typedef struct exl_constraint exl_constraint;

/* Compile source[0..len); errors name what is wrong or unsupported (and where). */
exl_status exl_constraint_compile(exl_constraint_kind kind, const char *source, size_t len, exl_constraint **out);
/* Drop the caller's reference (jobs keep theirs). */
void exl_constraint_free(exl_constraint *c);

/* ---------------------------------------------------------------- generator */

/* A generator runs many jobs (a prompt plus sampling settings and stop conditions)
 * through one model at once: continuous batching over a paged KV cache that the jobs
 * share. Jobs join and leave at any step; long prompts are fed in chunks under a
 * per-step token budget so running jobs keep decoding; pages are taken as sequences
 * grow, and when the cache runs dry the lowest-priority job is preempted (its pages
 * are released and it resumes later by recomputing, often from the prefix cache).
 * Full pages are identified by a hash chain over their tokens, so jobs with a common
 * prefix share pages; released pages stay cached (LRU) for later jobs.
 *
 * Threading: exl_generator_submit, _cancel, _pending and _stats may be called from
 * any thread at any time (a mutex guards the generator's inbox). exl_generator_step
 * must be called by one thread at a time, usually one thread looping on it; the
 * events it returns stay valid until that thread's next step or exl_generator_free.
 * While a step runs, nothing else may run the model (a session, another generator).
 * exl_generator_free must not race with any other call. */
typedef struct exl_generator exl_generator;

typedef struct exl_generator_params {
    int32_t n_pages;          /* KV cache pages; default 64; 0: as many as fit in memory (exl_cache_fit_tokens) */
    int32_t page_size;        /* token slots per page; default 256 */
    int32_t max_batch_tokens; /* tokens per forward step, 1..exl_model_desc.max_step_tokens; default 0: that
                               * maximum (512 on the CPU, 2048 on CUDA) */
    int32_t max_jobs;         /* jobs running at once (others wait), 1..max_batch_tokens; default 0: max_batch_tokens */
    int32_t prefix_cache;     /* reuse the cached K/V of identical prefixes; default 1 */
    int32_t cache_k_bits;     /* bits per cached key: 16 (default; 0 too), 8, 6 or 4 (exl_cache_token_bytes) */
    int32_t cache_v_bits;     /* bits per cached value, the same */
    float memory_fraction;    /* with n_pages 0: as exl_cache_fit_tokens; default 0 (its default) */
    /* Speculative decoding: a decoding job proposes up to draft_tokens tokens per step and the model checks them
     * all in the step's one forward; the accepted ones and one more token come out of it. Output is exactly
     * plain decoding's (greedy: the same tokens; sampling: the same distribution, by rejection). Jobs with a
     * constraint, log-probabilities or Mirostat decode without drafting. */
    exl_model *draft_model; /* a smaller model with the same tokenizer (its own KV cache, the same pages), or NULL */
    int32_t draft_tokens;   /* the most tokens proposed per step, 1..EXL_MAX_DRAFT_TOKENS; 0: no drafting (default) */
    int32_t ngram;          /* > 0: propose what followed the latest earlier match of the job's last ngram (down to
                             * 1) tokens, before asking the draft model (if any); 0: off (default) */
    int32_t draft_fixed;    /* 1: every step proposes draft_tokens; 0 (default): adaptive, see docs/speculative.md */
} exl_generator_params;

#define EXL_MAX_DRAFT_TOKENS 16

exl_generator_params exl_generator_default_params(void);

typedef struct exl_logit_bias {
    int32_t id;
    float bias; /* added to the token's logit; -INFINITY bans it */
} exl_logit_bias;

/* How the next token is drawn, applied to the fp32 logits in this order: logit bias,
 * penalties, temperature, then the filters top-k, top-p, min-p, typical, tail-free
 * (or Mirostat v2 instead of the filters), then a draw from the job's own random
 * stream, so a seed gives the same text whatever else runs in the batch. */
typedef struct exl_sampling {
    float temperature;                /* 0 = greedy (argmax, lowest id on ties); default 1 */
    int32_t top_k;                    /* keep the k most likely tokens; 0 = off */
    float top_p;                      /* keep the smallest set reaching probability top_p; 1 = off */
    float min_p;                      /* drop tokens below min_p times the top probability; 0 = off */
    float typical_p;                  /* locally typical sampling (Meister et al.); 1 = off */
    float tfs_z;                      /* tail-free sampling; 1 = off */
    int32_t mirostat;                 /* 0 = off, 2 = Mirostat v2 (the filters above are then unused) */
    float mirostat_tau;               /* target surprise in bits; default 5 */
    float mirostat_eta;               /* learning rate; default 0.1 */
    float repetition_penalty;         /* divide positive / multiply negative logits of seen tokens; 1 = off */
    float frequency_penalty;          /* subtract this times the token's count; 0 = off */
    float presence_penalty;           /* subtract this from every seen token; 0 = off */
    int32_t penalty_range;            /* "seen" = the last N tokens of prompt + completion; 0 = all */
    const exl_logit_bias *logit_bias; /* copied at submit */
    int32_t n_logit_bias;
    uint64_t seed; /* seeds the job's random stream (0 is a seed like any other) */
} exl_sampling;

/* The one set of sampling defaults: exl run, exl chat and the server (for the fields a request
 * leaves out) all start from it. Temperature 1 with every filter and penalty off: the model's own
 * distribution, as OpenAI's API and transformers' generate() default to; seed 0. */
exl_sampling exl_sampling_default(void);

typedef struct exl_job_params {
    const int32_t *ids; /* the prompt as token ids, or NULL to use text */
    int32_t n_ids;
    const char *text;        /* the prompt as UTF-8 text (when ids is NULL) */
    int32_t add_special;     /* text: apply the tokenizer's post-processor (BOS); default 1 */
    int32_t max_new_tokens;  /* default 256 */
    int32_t min_new_tokens;  /* stop tokens are suppressed before this many; default 0 */
    const int32_t *stop_ids; /* stop tokens besides the model's and tokenizer's eos ids */
    int32_t n_stop_ids;
    int32_t ignore_eos;              /* do not stop on the eos ids (stop_ids still apply) */
    const char *const *stop_strings; /* end the completion before the first match */
    int32_t n_stop_strings;
    const char *const *banned_strings; /* never produced: on a match the job rewinds and resamples */
    int32_t n_banned_strings;
    int32_t logprobs;           /* report the log-probability of each token (model distribution) */
    int32_t top_logprobs;       /* and of the 0..20 most likely tokens at each position */
    int32_t priority;           /* higher runs first and is preempted last; default 0 */
    exl_constraint *constraint; /* the output must match it (the job takes a reference); NULL: free text */
    exl_sampling sampling;
    int32_t no_draft; /* 1: decode without the generator's speculative drafting */
    void *user;       /* handed back in events */
    /* LoRA adapters of this job (copied; each must stay loaded until the job ends); n_lora 0: the model's set
     * (exl_model_set_lora) */
    const exl_lora_use *lora;
    int32_t n_lora;
} exl_job_params;

exl_job_params exl_job_default_params(void);

typedef enum exl_finish_reason {
    EXL_FINISH_NONE = 0,  /* still running */
    EXL_FINISH_STOP,      /* a stop token or stop string */
    EXL_FINISH_LENGTH,    /* max_new_tokens reached */
    EXL_FINISH_CANCELLED, /* exl_generator_cancel */
    EXL_FINISH_ERROR,     /* see error */
} exl_finish_reason;

const char *exl_finish_reason_str(exl_finish_reason r); /* "stop", "length", ... */

typedef struct exl_token_logprob {
    int32_t id;
    float logprob;
} exl_token_logprob;

/* What happened to one job during a step. Text is streamed in whole characters; it and
 * the ids are final (a banned string can no longer take them back). */
typedef struct exl_gen_event {
    uint64_t job;
    void *user;
    const char *text; /* new completion text, NUL-terminated */
    size_t text_len;
    const int32_t *ids; /* new tokens (a stop token included) */
    int32_t n_ids;
    const float *logprobs;                 /* [n_ids] when requested, else NULL */
    const exl_token_logprob *top_logprobs; /* [n_ids * n_top_logprobs], most likely first */
    int32_t n_top_logprobs;
    exl_finish_reason finish;
    int32_t stop_token;      /* the stop token that ended the job, else -1 */
    const char *stop_string; /* the stop string that ended it, else NULL */
    int32_t n_prompt_tokens;
    int32_t n_cached_tokens; /* prompt tokens found in the prefix cache at admission */
    int32_t n_generated;     /* tokens generated so far */
    const char *error;       /* the message when finish is EXL_FINISH_ERROR */

    int32_t n_draft_proposed; /* speculative decoding: tokens drafted for this job so far */
    int32_t n_draft_accepted; /* and of those, accepted */
} exl_gen_event;

/* params NULL: the defaults. tok is used for text prompts, stop/banned strings and the
 * event text; the model and the tokenizer must outlive the generator. */
exl_status exl_generator_init(exl_model *model, const exl_tokenizer *tok, const exl_generator_params *params,
                              exl_generator **out);
void exl_generator_free(exl_generator *gen);
/* Queue a job (everything in params is copied); *job receives its id (never 0). */
exl_status exl_generator_submit(exl_generator *gen, const exl_job_params *params, uint64_t *job);
/* Ask for a job to end; its last event (EXL_FINISH_CANCELLED) comes from the next step.
 * EXL_ERR_ARG when no such job is waiting or running (it may just have finished). */
exl_status exl_generator_cancel(exl_generator *gen, uint64_t job);
/* Run one forward step over the scheduled jobs and return what happened (*n_events may
 * be 0, e.g. while a long prompt is fed). When the step fails the jobs it held end with
 * EXL_FINISH_ERROR events, which are returned along with the failing status. */
exl_status exl_generator_step(exl_generator *gen, const exl_gen_event **events, int32_t *n_events);
/* Jobs submitted and not yet finished (waiting or running). */
int32_t exl_generator_pending(exl_generator *gen);

typedef struct exl_generator_stats {
    int64_t steps;             /* forward steps run */
    int64_t tokens_computed;   /* token rows run through the model (prefill, decode, recompute) */
    int64_t tokens_generated;  /* tokens sampled and kept */
    int64_t prefix_hit_tokens; /* tokens whose K/V came from the prefix cache */
    int64_t pages_shared;      /* full pages reused from the prefix cache */
    int64_t pages_copied;      /* partly matching pages copied from the prefix cache */
    int64_t preemptions;
    int64_t rewinds;        /* resamples forced by banned strings */
    int64_t draft_proposed; /* speculative decoding: tokens drafted */
    int64_t draft_accepted; /* drafted tokens the model accepted */
    int64_t jobs_submitted, jobs_finished;
    int32_t jobs_waiting, jobs_running;
    int32_t pages_total;
    int32_t pages_used;      /* held by jobs */
    int32_t pages_cached;    /* held by no job, keeping K/V for the prefix cache */
    int32_t pages_free;      /* empty */
    double seconds_forward;  /* wall time in the model's forward pass (logits on the host included) */
    double seconds_sampling; /* wall time sampling, detokenizing and checking stop conditions */
} exl_generator_stats;

/* A snapshot as of the end of the last step. */
void exl_generator_stats_get(exl_generator *gen, exl_generator_stats *out);

/* ---------------------------------------------------------------- KV cache sizing */

/* The bytes one token takes in a KV cache of the model (every layer's key and value) with k_bits per key and v_bits
 * per value: 16 (0 too) keeps them at the backend's own precision (fp16 on CUDA, fp32 on the CPU); 8, 6 and 4
 * quantize each head in groups of 32 values (16 or 8 where head_dim is not a multiple of 32), Hadamard-rotated,
 * with an fp16 scale per group. An error for other widths, or a head_dim no group fits. */
exl_status exl_cache_token_bytes(const exl_model *model, int32_t k_bits, int32_t v_bits, int64_t *bytes);

/* The tokens of such a cache that fit in the memory the model's device has left (0 when none fits). On a GPU:
 * memory_fraction of its memory (0 = 0.9; EXL_CUDA_MEMORY_LIMIT=24GiB makes a larger GPU count as that much)
 * less what is in use now (the weights, the forward buffers, other processes) and less a margin of 512 MiB for
 * buffers that grow later. On the CPU, where the weights are mapped files and memory_fraction is not used: a
 * quarter of the RAM that the weight files leave, at most 4 GiB of cache. */
exl_status exl_cache_fit_tokens(exl_model *model, int32_t k_bits, int32_t v_bits, float memory_fraction,
                                int64_t *tokens);

/* ---------------------------------------------------------------- quantizer */

/* Convert a Hugging Face model directory to EXL2 (measured mixed bit widths within a
 * bits-per-weight budget) or GPTQ, with Hessians from calibration text, layer by layer on
 * the CPU (its big fp32 products on the GPU when `device` gets one). The output directory
 * is complete (weights, config.json with quantization_config, tokenizer and other files
 * copied). A killed run resumes from the last finished layer when started again with the
 * same parameters (on any device). */
typedef enum exl_quant_format { EXL_QUANT_EXL2 = 0, EXL_QUANT_GPTQ } exl_quant_format;

/* Where a quantization stands. Stages: "calibrating", "measuring" and "quantizing" (decoder layers), "head",
 * "writing". */
typedef struct exl_quantize_status {
    const char *stage;
    int32_t layer, n_layers;   /* the layer being worked on, of the decoder's */
    double layer_fraction;     /* of that layer done */
    double elapsed, remaining; /* seconds: this run so far, and an estimate of what is left (< 0: none yet) */
    double fraction;           /* of the run done (an estimate, by the time layers take) */
    int32_t finished;          /* 1: `layer` just finished; seconds and the blocks below are its */
    double seconds;            /* the finished layer's */
    int32_t n_blocks;          /* attention, then the MLP or the experts */
    struct {
        const char *name; /* "self_attn", "mlp", "block_sparse_moe" */
        double accuracy;  /* 1 - the relative error of the hidden states after the block (measuring: of the
                                 * best recipe within the target bits per weight) */
        double bpw;       /* measuring: that recipe's; quantizing: the chosen one's (stored bits per weight) */
    } block[2];
} exl_quantize_status;

typedef struct exl_quantize_params {
    const char *in_dir, *out_dir; /* out_dir must be absent, empty, or an unfinished run */
    exl_quant_format format;
    double bpw;                     /* EXL2: decoder-layer bits per weight; default 4.0 */
    int32_t head_bits;              /* EXL2: bits of lm_head (2-6 or 8); default 6 */
    const char *measurement;        /* EXL2: reuse this measurement.json (skips the measuring pass) */
    int32_t bits;                   /* GPTQ: 2, 3, 4 or 8; default 4 */
    int32_t group_size;             /* GPTQ: default 128; -1 = one group */
    int32_t act_order, sym;         /* GPTQ: default 0, 0 */
    int32_t rtn;                    /* GPTQ: round to nearest (no Hessian; calibration unused) */
    const char *const *calibration; /* UTF-8 text files */
    int32_t n_calibration;
    int32_t rows, length; /* calibration rows of `length` tokens; default 32 x 512 */
    int32_t n_threads;    /* 0 = one per core */
    exl_device device;    /* default AUTO: the GPU when one is usable, else the CPU */
    /* called as work advances (stage: "measuring", "quantizing", "writing"; done: finished layers) */
    void (*progress)(void *user, const char *stage, int32_t done, int32_t total);
    void *progress_user;
    /* called at least every few seconds of work, and once for each finished layer (exl_quantize_status) */
    void (*status)(void *user, const exl_quantize_status *s);
    void *status_user;
} exl_quantize_params;

exl_quantize_params exl_quantize_default_params(void);
/* *report (may be NULL): a text summary (the device, bits per layer, bits per weight); exl_string_free. */
exl_status exl_quantize(const exl_quantize_params *params, char **report);

#ifdef __cplusplus
}
#endif
#endif /* EXL_H */
