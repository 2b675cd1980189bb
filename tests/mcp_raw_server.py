"""A raw newline-JSON-RPC MCP stdio server (no SDK), for replies the SDK's server cannot send.

Its one tool `go` answers by its `kind` argument: `meta` (one text block and a `_meta` of `n`
small objects), `structured` (the same in `structuredContent`), `deep` (a `_meta` nested `n`
lists deep, which no JSON parser here accepts) or anything else ("ok").
"""

from __future__ import annotations

import json
import sys


def send(raw: str) -> None:
    sys.stdout.write(raw + "\n")
    sys.stdout.flush()


def answer(call_id: int, args: dict[str, object]) -> str:
    kind, n = args.get("kind"), int(str(args.get("n", 0)))
    text = [{"type": "text", "text": "s"}]
    if kind == "meta":
        result = {"content": text, "_meta": {"blob": [{"k": j} for j in range(n)]}}
    elif kind == "structured":
        result = {"content": text, "structuredContent": {"blob": [{"k": j} for j in range(n)]}}
    elif kind == "deep":
        deep = "[" * n + "]" * n
        return (
            f'{{"jsonrpc":"2.0","id":{call_id},"result":{{"content":[],"_meta":{{"x":{deep}}}}}}}'
        )
    else:
        result = {"content": [{"type": "text", "text": "ok"}]}
    return json.dumps({"jsonrpc": "2.0", "id": call_id, "result": result})


def main() -> None:
    tool = {"name": "go", "description": "answer", "inputSchema": {"type": "object"}}
    for line in sys.stdin:
        message = json.loads(line)
        method, call_id = message.get("method"), message.get("id")
        if method == "initialize":
            version = message["params"]["protocolVersion"]
            result = {
                "protocolVersion": version,
                "capabilities": {"tools": {}},
                "serverInfo": {"name": "raw", "version": "1"},
            }
        elif method == "tools/list":
            result = {"tools": [tool]}
        elif method == "tools/call":
            send(answer(call_id, message["params"].get("arguments") or {}))
            continue
        else:
            result = {}
        if call_id is not None:
            send(json.dumps({"jsonrpc": "2.0", "id": call_id, "result": result}))


if __name__ == "__main__":
    main()
