/* qz_json.c - measurement.json in ExLlamaV2's layout: {"measurement": {"model.layers.N.self_attn":
 * [{accuracy, total_bits, q_proj: {group_size: {"4": 128}, bits: [4], bits_prop: [1],
 * scale_bits: 4}, ...}, ...], ...}, "last_module_idx": n}. Files written by ExLlamaV2 read
 * back too (bit counts are recomputed with exl's rule). */
#include "convert/qz.h"

#include "base/alloc.h"
#include "base/error.h"
#include "io/json_file.h"

#include <stdio.h>
#include <string.h>

static cJSON *opt_json(const exl_qz_opt *o) {
    cJSON *j = cJSON_CreateObject(), *gs = cJSON_AddObjectToObject(j, "group_size");
    cJSON *bits = cJSON_AddArrayToObject(j, "bits"), *prop = cJSON_AddArrayToObject(j, "bits_prop");
    for (int32_t w = 0; w < o->n; w++) {
        char key[8];
        snprintf(key, sizeof key, "%d", o->bits[w]);
        cJSON_AddNumberToObject(gs, key, o->gs[w]);
        cJSON_AddItemToArray(bits, cJSON_CreateNumber(o->bits[w]));
        cJSON_AddItemToArray(prop, cJSON_CreateNumber(o->prop[w]));
    }
    cJSON_AddNumberToObject(j, "scale_bits", 4);
    return j;
}

exl_status exl_qz_measurement_save(const exl_qz_measurement *m, int32_t last_layer, const char *path) {
    cJSON *root = cJSON_CreateObject(), *meas = cJSON_AddObjectToObject(root, "measurement");
    for (int32_t b = 0; b < m->n_blocks; b++) {
        const exl_qz_block_meas *bm = &m->b[b];
        cJSON *list = cJSON_AddArrayToObject(meas, bm->name);
        for (int32_t r = 0; r < bm->n; r++) {
            cJSON *e = cJSON_CreateObject();
            cJSON_AddNumberToObject(e, "accuracy", bm->r[r].accuracy);
            cJSON_AddNumberToObject(e, "total_bits", bm->r[r].total_bits);
            for (int32_t i = 0; i < bm->desc->n_linears; i++)
                cJSON_AddItemToObject(e, bm->desc->names[i], opt_json(&bm->r[r].opt[i]));
            cJSON_AddItemToArray(list, e);
        }
    }
    cJSON_AddNumberToObject(root, "last_module_idx", last_layer);
    exl_status st = exl_qz_write_json(root, path);
    cJSON_Delete(root);
    return st;
}

static exl_status opt_parse(const char *path, const char *what, const cJSON *j, exl_qz_opt *o) {
    const cJSON *bits = cJSON_GetObjectItemCaseSensitive(j, "bits");
    const cJSON *prop = cJSON_GetObjectItemCaseSensitive(j, "bits_prop");
    const cJSON *gs = cJSON_GetObjectItemCaseSensitive(j, "group_size");
    int n = cJSON_GetArraySize(bits);
    if (!cJSON_IsArray(bits) || !cJSON_IsArray(prop) || !cJSON_IsObject(gs) || n < 1 || n > EXL_QZ_MAX_WIDTHS ||
        cJSON_GetArraySize(prop) != n)
        return exl_fail(EXL_ERR_FORMAT, "%s: %s: bits, bits_prop or group_size missing or malformed", path, what);
    memset(o, 0, sizeof *o);
    o->n = n;
    for (int w = 0; w < n; w++) {
        const cJSON *b = cJSON_GetArrayItem(bits, w), *p = cJSON_GetArrayItem(prop, w);
        char key[8];
        snprintf(key, sizeof key, "%d", cJSON_IsNumber(b) ? b->valueint : 0);
        const cJSON *g = cJSON_GetObjectItemCaseSensitive(gs, key);
        if (!cJSON_IsNumber(b) || !cJSON_IsNumber(p) || !cJSON_IsNumber(g) || b->valueint < 2 || b->valueint > 8 ||
            b->valueint == 7 || (w && b->valueint >= o->bits[w - 1]) || g->valueint < 32 || g->valueint % 32 ||
            p->valuedouble < 0 || p->valuedouble > 1)
            return exl_fail(EXL_ERR_FORMAT,
                            "%s: %s: bad width %d (bits 2-6 or 8, descending; group size a multiple of 32)", path, what,
                            w);
        o->bits[w] = b->valueint;
        o->prop[w] = p->valuedouble;
        o->gs[w] = g->valueint;
    }
    return EXL_OK;
}

static exl_status block_parse(const char *path, const cJSON *list, const exl_qz_block_desc *d, const char *name,
                              exl_qz_block_meas *bm) {
    int n = cJSON_GetArraySize(list);
    if (!cJSON_IsArray(list) || n < 1)
        return exl_fail(EXL_ERR_FORMAT, "%s: %s: no recipes", path, name);
    snprintf(bm->name, sizeof bm->name, "%.90s", name);
    bm->desc = d;
    if (!(bm->r = exl_calloc((size_t)n, sizeof *bm->r)))
        return exl_fail(EXL_ERR_NOMEM, "out of memory");
    bm->n = n;
    for (int r = 0; r < n; r++) {
        const cJSON *e = cJSON_GetArrayItem(list, r), *acc = cJSON_GetObjectItemCaseSensitive(e, "accuracy");
        if (!cJSON_IsNumber(acc))
            return exl_fail(EXL_ERR_FORMAT, "%s: %s: recipe %d has no accuracy", path, name, r);
        bm->r[r].accuracy = acc->valuedouble;
        for (int32_t i = 0; i < d->n_linears; i++) {
            char what[320];
            snprintf(what, sizeof what, "%s.%s (recipe %d)", name, d->names[i], r);
            EXL_TRY(opt_parse(path, what, cJSON_GetObjectItemCaseSensitive(e, d->names[i]), &bm->r[r].opt[i]));
            bm->r[r].total_bits += d->copies * exl_exl2_opt_bits(&bm->r[r].opt[i], d->K[i], d->N[i]);
        }
    }
    return EXL_OK;
}

exl_status exl_qz_measurement_load(const char *path, const exl_qz_block_desc *const *descs, int32_t n_layers,
                                   exl_qz_measurement *m, int32_t *n_done_layers) {
    cJSON *root;
    EXL_TRY(exl_json_read_file(path, &root));
    memset(m, 0, sizeof *m);
    exl_status st = EXL_OK;
    const cJSON *meas = cJSON_GetObjectItemCaseSensitive(root, "measurement");
    if (!cJSON_IsObject(meas))
        st = exl_fail(EXL_ERR_FORMAT, "%s: no \"measurement\" object", path);
    if (st == EXL_OK && !(m->b = exl_calloc((size_t)n_layers * 2, sizeof *m->b)))
        st = exl_fail(EXL_ERR_NOMEM, "out of memory");
    int32_t done = 0;
    for (int32_t l = 0; l < n_layers && st == EXL_OK; l++) {
        char names[2][96];
        snprintf(names[0], sizeof names[0], "model.layers.%d.%s", l, descs[2 * l]->suffix);
        snprintf(names[1], sizeof names[1], "model.layers.%d.%s", l, descs[2 * l + 1]->suffix);
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(meas, names[0]);
        const cJSON *b = cJSON_GetObjectItemCaseSensitive(meas, names[1]);
        if (!a || !b)
            break;
        for (int k = 0; k < 2 && st == EXL_OK; k++) {
            st = block_parse(path, k ? b : a, descs[2 * l + k], names[k], &m->b[m->n_blocks]);
            m->n_blocks++;
        }
        done += st == EXL_OK;
    }
    cJSON_Delete(root);
    if (st != EXL_OK)
        exl_qz_measurement_free(m);
    *n_done_layers = done;
    return st;
}
