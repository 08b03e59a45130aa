/* chat_page.c - GET /: the embedded web chat (chat_page.h). */
#include "server/chat_page.h"

#include "base/alloc.h"
#include "server/routes.h"

#include <string.h>

void exl_chat_page(exl_http_reply *reply) {
    char *body = exl_malloc(exl_chat_page_html_len);
    if (!body) {
        exl_reply_json(reply, 500, NULL);
        return;
    }
    memcpy(body, exl_chat_page_html, exl_chat_page_html_len);
    reply->status = 200;
    reply->content_type = "text/html; charset=utf-8";
    reply->body = body;
    reply->body_len = exl_chat_page_html_len;
}
