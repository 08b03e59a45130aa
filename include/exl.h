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

/* ---------------------------------------------------------------- status */

typedef enum exl_status {
    EXL_OK = 0,
    EXL_ERR_IO,           /* a file is missing, unreadable or truncated */
    EXL_ERR_FORMAT,       /* a file is readable but its content is malformed */
    EXL_ERR_UNSUPPORTED,  /* well-formed but not something exl can run */
    EXL_ERR_NOMEM,        /* an allocation failed (host or device) */
    EXL_ERR_ARG,          /* a caller passed an invalid argument */
    EXL_ERR_DEVICE,       /* the accelerator or its driver failed */
    EXL_ERR_STATE,        /* the call is not valid in the object's current state */
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
    EXL_DEVICE_CUDA,     /* insist on the GPU: failing to get one is an error */
} exl_device;

typedef struct exl_model_params {
    exl_device device;
    int32_t n_threads;   /* CPU worker threads; 0 = one per core */
} exl_model_params;

exl_model_params exl_model_default_params(void);

/* Load a Hugging Face style model directory (config.json + safetensors). */
exl_status exl_model_load(const char *dir, const exl_model_params *params, exl_model **out);
void exl_model_free(exl_model *model);

typedef struct exl_model_desc {
    char arch[32];             /* "llama", "mistral", "qwen2", "gemma" */
    int32_t vocab_size;
    int32_t hidden_size;
    int32_t intermediate_size;
    int32_t n_layers;
    int32_t n_heads;
    int32_t n_kv_heads;
    int32_t head_dim;
    int32_t max_position_embeddings;
    int32_t bos_token_id;      /* -1 if none */
    int32_t n_eos_token_ids;
    int32_t eos_token_ids[8];
    int32_t tied_embeddings;
    char backend[16];          /* "cpu" or "cuda" */
} exl_model_desc;

void exl_model_describe(const exl_model *model, exl_model_desc *out);

/* A human-readable report (architecture, sizes, dtypes per tensor group, parameter
 * count, memory needed). The string is owned by the caller; free with exl_string_free. */
exl_status exl_model_report(const exl_model *model, char **out);
void exl_string_free(char *s);

/* ---------------------------------------------------------------- sessions */

/* A session is one token sequence with its own KV cache on the model's backend. */
typedef struct exl_session exl_session;

exl_status exl_session_init(exl_model *model, int32_t max_tokens, exl_session **out);
void exl_session_free(exl_session *session);
/* Forget all tokens (the cache is kept allocated). */
void exl_session_reset(exl_session *session);
int32_t exl_session_length(const exl_session *session);

/* Append n tokens and run them through the model. If logits is not NULL it receives
 * the fp32 logits of every appended position, n * vocab_size floats, row-major. If
 * last_logits is not NULL it receives only the last position's vocab_size floats. */
exl_status exl_session_eval(exl_session *session, const int32_t *ids, int32_t n,
                            float *logits, float *last_logits);

/* Write one fp32 matrix [rows, cols] as a safetensors file holding a single tensor. */
exl_status exl_tensor_save(const char *path, const char *name, const float *data, int32_t rows, int32_t cols);

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

/* Encode UTF-8 text as Hugging Face `tokenizer(text, add_special_tokens=add_special)`
 * does: added tokens in the text are always matched; add_special applies the
 * post-processor (BOS/EOS). *ids is allocated; free with exl_ids_free. */
exl_status exl_tokenizer_encode(const exl_tokenizer *tok, const char *text, size_t len, int add_special,
                                int32_t **ids, int32_t *n_ids);
void exl_ids_free(int32_t *ids);
/* Decode like `tokenizer.decode(ids, skip_special_tokens=skip_special)`; free with exl_string_free. */
exl_status exl_tokenizer_decode(const exl_tokenizer *tok, const int32_t *ids, int32_t n, int skip_special,
                                char **text);

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
    const char *role;    /* "system", "user", "assistant", "tool" */
    const char *content;
} exl_chat_message;

/* Render the model's chat template (tokenizer_config.json `chat_template`, or a
 * documented fallback) as transformers' apply_chat_template(tokenize=False) does.
 * tools_json: a JSON array of tool definitions, or NULL. Free with exl_string_free. */
exl_status exl_chat_apply(const exl_tokenizer *tok, const exl_chat_message *messages, int32_t n_messages,
                          int add_generation_prompt, const char *tools_json, char **text);

#ifdef __cplusplus
}
#endif
#endif /* EXL_H */
