/* chat_page.h - GET /: the web chat (src/server/web/chat.html), embedded in the binary at build time by
 * cmake/chat_page.cmake. */
#ifndef EXL_SERVER_CHAT_PAGE_H
#define EXL_SERVER_CHAT_PAGE_H

#include "server/http.h"

#include <stddef.h>

/* The page's bytes (generated from chat.html; not NUL-terminated). */
extern const unsigned char exl_chat_page_html[];
extern const size_t exl_chat_page_html_len;

/* Answer with the page (text/html). */
void exl_chat_page(exl_http_reply *reply);

#endif
