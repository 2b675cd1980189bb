"""Treadle's private HTTP/1.1 layer: a connection pool for one kind of request, replies parsed by
llhttp (`httptools`), proxies, TLS and connecting as users' networks need them.

It knows nothing of LLMs: it takes a URL, headers and a body and hands back plain reply values or
one of the errors in `treadle._http.errors`. `treadle.llm` classifies those once, in one place.
Nothing here blocks the event loop. Private: names may move; `treadle.llm` is its only user.
"""
