/* engine.h - the engine thread: the one thread that owns the generator and steps it.
 *
 * HTTP threads submit and cancel jobs through it (both thread-safe in the generator);
 * a submit wakes the engine, which sleeps while no job is pending, and every event it
 * gets is copied to the job's request queue (stream.h). */
#ifndef EXL_SERVER_ENGINE_H
#define EXL_SERVER_ENGINE_H

#include "exl.h"
#include "server/stream.h"

typedef struct exl_engine exl_engine;

/* Create the generator and start the thread. The model and tokenizer must outlive it. */
exl_status exl_engine_start(exl_model *model, const exl_tokenizer *tok, const exl_generator_params *params,
                            exl_engine **out);
/* Let the pending jobs end (callers cancel theirs first), stop the thread, free all. */
void exl_engine_stop(exl_engine *e);
/* Submit a job whose events go to `slot` (params->user is set here); takes a reference
 * on the slot's queue for the job. */
exl_status exl_engine_submit(exl_engine *e, exl_job_params *params, exl_stream_slot *slot);
/* Cancel a job if it is still waiting or running (its final event follows). */
void exl_engine_cancel(exl_engine *e, uint64_t job);
void exl_engine_stats(exl_engine *e, exl_generator_stats *out);
/* Run fn(ctx) on the engine thread between two steps (what changes the model, such as loading an adapter) and
 * return its status once it ran. One caller at a time is served; others wait their turn. */
exl_status exl_engine_call(exl_engine *e, exl_status (*fn)(void *ctx), void *ctx);

#endif
