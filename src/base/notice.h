/* notice.h - one-line notices about what the library did on the caller's behalf that is worth knowing but is not
 * an error (a stale weights index it ignored, a vision tower it left out). By default each goes to stderr as
 * "exl: <text>"; a program or test may take them instead. */
#ifndef EXL_BASE_NOTICE_H
#define EXL_BASE_NOTICE_H

typedef void (*exl_notice_fn)(void *user, const char *text);

/* Send notices to fn (NULL: back to stderr). Set it while no other thread may give a notice. */
void exl_notice_set_handler(exl_notice_fn fn, void *user);
void exl_notice(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

#endif
