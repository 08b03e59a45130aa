/* jinja_ast.h - tokens, syntax tree and the parsed template, shared by the lexer,
 * parser and evaluator of the Jinja subset. */
#ifndef EXL_TOKENIZER_JINJA_AST_H
#define EXL_TOKENIZER_JINJA_AST_H

#include "jinja/jinja.h"
#include "jinja/jinja_value.h"

/* Parse-time bounds: nesting of expressions and of blocks. */
#define EXL_JINJA_MAX_DEPTH 128
#define EXL_JINJA_MAX_SOURCE ((size_t)16 << 20)

/* ---------------------------------------------------------------- tokens */

typedef enum exl_jtok_type {
    EXL_JTOK_TEXT,        /* template data, whitespace control already applied */
    EXL_JTOK_VAR_BEGIN,   /* {{ */
    EXL_JTOK_VAR_END,     /* }} */
    EXL_JTOK_BLOCK_BEGIN, /* {% */
    EXL_JTOK_BLOCK_END,   /* %} */
    EXL_JTOK_NAME,
    EXL_JTOK_STRING, /* sval/slen: the unescaped text */
    EXL_JTOK_INT,
    EXL_JTOK_FLOAT,
    EXL_JTOK_OP, /* p/len: the operator's spelling */
    EXL_JTOK_EOF,
} exl_jtok_type;

typedef struct exl_jtok {
    exl_jtok_type type;
    size_t pos;    /* offset in the (normalized) source */
    const char *p; /* TEXT, NAME, OP: the bytes in the source */
    size_t len;
    char *sval; /* STRING: allocated */
    size_t slen;
    int64_t ival;
    double fval;
} exl_jtok;

typedef struct exl_jtoks {
    exl_jtok *v;
    size_t n, cap;
} exl_jtoks;

/* ---------------------------------------------------------------- nodes */

typedef enum exl_jnode_kind {
    /* statements */
    EXL_JN_BLOCK,  /* kids: statements */
    EXL_JN_TEXT,   /* lit */
    EXL_JN_OUTPUT, /* kids[0] */
    EXL_JN_IF,     /* cond, then BLOCK, else BLOCK or NULL */
    EXL_JN_FOR,    /* target, iterable, filter or NULL, body, else or NULL */
    EXL_JN_SET,    /* target, value (flag: value is a BLOCK to capture) */
    EXL_JN_MACRO,  /* name; body, then (param NAME, default or NULL) pairs */
    EXL_JN_BREAK,
    EXL_JN_CONTINUE,
    /* expressions */
    EXL_JN_LIT,    /* lit */
    EXL_JN_NAME,   /* name */
    EXL_JN_ATTR,   /* kids[0].name */
    EXL_JN_ITEM,   /* kids[0][kids[1]] */
    EXL_JN_SLICE,  /* kids[0][start:stop:step], absent parts NULL */
    EXL_JN_CALL,   /* kids[0](kids[1..]), kw[i] names keyword arguments */
    EXL_JN_FILTER, /* kids[0] | name(kids[1..]) */
    EXL_JN_TEST,   /* kids[0] is [not] name(kids[1..]); flag: negated */
    EXL_JN_NEG,    /* -kids[0] */
    EXL_JN_POS,    /* +kids[0] */
    EXL_JN_NOT,
    EXL_JN_AND,
    EXL_JN_OR,
    EXL_JN_BINARY,  /* op: an exl_jop */
    EXL_JN_COMPARE, /* kids[0] ops[0] kids[1] ops[1] kids[2] ... */
    EXL_JN_COND,    /* kids[0] if kids[1] else kids[2] (NULL: undefined) */
    EXL_JN_LIST,
    EXL_JN_TUPLE,
    EXL_JN_DICT, /* key, value, key, value, ... */
} exl_jnode_kind;

typedef enum exl_jop {
    EXL_JOP_ADD = 1,
    EXL_JOP_SUB,
    EXL_JOP_MUL,
    EXL_JOP_DIV,
    EXL_JOP_FLOORDIV,
    EXL_JOP_MOD,
    EXL_JOP_POW,
    EXL_JOP_CONCAT,
    EXL_JOP_EQ,
    EXL_JOP_NE,
    EXL_JOP_LT,
    EXL_JOP_LE,
    EXL_JOP_GT,
    EXL_JOP_GE,
    EXL_JOP_IN,
    EXL_JOP_NOTIN,
} exl_jop;

typedef struct exl_jnode {
    exl_jnode_kind kind;
    int op; /* BINARY */
    int flag;
    size_t pos; /* source offset, for messages */
    char *name;
    exl_jv lit; /* immortal */
    struct exl_jnode **kids;
    size_t n_kids;
    char **kw;          /* NULL, or one (possibly NULL) keyword name per kid */
    unsigned char *ops; /* COMPARE: n_kids - 1 operators */
} exl_jnode;

struct exl_jinja {
    char *name;
    char *src; /* normalized source: \r\n and \r as \n, no trailing newline */
    size_t len;
    exl_jnode *root;
};

/* Split the normalized source into tokens (with trim_blocks, lstrip_blocks and the
 * -/+ markers applied to TEXT). Errors name "t->name:line:col". */
exl_status exl_jinja_lex(const exl_jinja *t, exl_jtoks *out);
void exl_jinja_toks_free(exl_jtoks *toks);

/* Line and column (1-based) of a source offset. */
void exl_jinja_linecol(const exl_jinja *t, size_t pos, int *line, int *col);

void exl_jnode_free(exl_jnode *n);

#endif
