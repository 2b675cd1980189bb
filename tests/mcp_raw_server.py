"""A raw newline-JSON-RPC MCP stdio server (no SDK), for replies the SDK's server cannot send.

Its one tool `go` answers by its `kind` argument: `meta` (one text block and a `_meta` of `n`
small objects), `structured` (the same in `structuredContent`), `deep` (a `_meta` nested `n`
lists deep, which no JSON parser here accepts), `fill_structured` / `fill_blocks` (as many
small entries in `structuredContent`, or text blocks, as fit in a line of at most `size` bytes)
or anything else ("ok"); `fill_lists` fills it with `[[[]]]` entries in `structuredContent`
(the most lists per byte), `lists` sends `n` of those, `long` a `structuredContent` string `s` of
`2n + 1` characters, `floats` `n` numbers `1e-400` (each a slow `strtod`) and `fill_floats` as
many as fit, `combo` `lists` `[[[]]]`, `exps` `1e-400` and `ints` integers of 4,000 digits,
`announce` a `notifications/tools/list_changed` whose `_meta` holds `n` `[[[]]]`
entries before its reply, and `odd` a `structuredContent` of `n` small rows and one `1e999`
(`"odd": "inf"`) or one string of 20,001 characters (`"odd": "long"`). `--tools N` lists N
tools more besides `go`; `--output-schema` gives `go` an output schema that `fill_structured`
entries of 9 break; `--pattern P` gives its input schema a string `s` matching `P` (and its
output schema too with `--output-pattern`), or with `--patterns N` a `patternProperties` of N
distinct patterns `(?:i)P`.
"""

from __future__ import annotations

import json
import sys

TOOLS = int(sys.argv[sys.argv.index("--tools") + 1]) if "--tools" in sys.argv else 0


def send(raw: str) -> None:
    sys.stdout.write(raw + "\n")
    sys.stdout.flush()


def filled(call_id: int, kind: object, size: int) -> str:
    """The longest reply of `kind` whose line (newline included) has at most `size` bytes."""

    def line(n: int) -> str:
        if kind == "fill_structured":
            blob = [{"k": j % 10} for j in range(n)]
            result = {"content": [{"type": "text", "text": "s"}], "structuredContent": {"b": blob}}
        elif kind == "fill_lists":
            result = {"content": [{"type": "text", "text": "s"}], "structuredContent": lists(n)}
        elif kind == "fill_floats":
            return floats(call_id, n)
        else:
            result = {"content": [{"type": "text", "text": "t"} for _ in range(n)]}
        reply = {"jsonrpc": "2.0", "id": call_id, "result": result}
        return json.dumps(reply, separators=(",", ":"))

    low, high = 0, size
    while low < high:  # the largest n that fits
        middle = (low + high + 1) // 2
        low, high = (middle, high) if len(line(middle)) < size else (low, middle - 1)
    return line(low)


def lists(n: int) -> dict[str, object]:
    """`n` entries `[[[]]]`: the most lists per byte a flat JSON text can hold."""
    return {"x": [[[[]]] for _ in range(n)]}


def floats(call_id: int, n: int, form: str = "1e-400") -> str:
    """A reply whose `structuredContent` is `n` numbers `form` (json.dumps cannot write 1e-400)."""
    text = ",".join([form] * n)
    return (
        f'{{"jsonrpc":"2.0","id":{call_id},"result":{{"content":[{{"type":"text","text":"s"}}],'
        f'"structuredContent":{{"x":[{text}]}}}}}}'
    )


def combo(call_id: int, n_lists: int, n_exps: int, n_ints: int) -> str:
    """A reply of `[[[]]]` entries, `1e-400`s and integers of 4,000 digits, in that order."""
    parts = ["[[[]]]"] * n_lists + ["1e-400"] * n_exps + ["9" * 4000] * n_ints
    text = ",".join(parts)
    return (
        f'{{"jsonrpc":"2.0","id":{call_id},"result":{{"content":[{{"type":"text","text":"s"}}],'
        f'"structuredContent":{{"x":[{text}]}}}}}}'
    )


def answer(call_id: int, args: dict[str, object]) -> str:
    kind, n = args.get("kind"), int(str(args.get("n", 0)))
    if kind in ("fill_structured", "fill_blocks", "fill_lists", "fill_floats"):
        return filled(call_id, kind, int(str(args["size"])))
    text = [{"type": "text", "text": "s"}]
    if kind == "floats":
        return floats(call_id, n, str(args.get("form", "1e-400")))
    if kind == "combo":
        return combo(call_id, *(int(str(args[key])) for key in ("lists", "exps", "ints")))
    if kind == "announce":
        note = {"method": "notifications/tools/list_changed", "params": {"_meta": lists(n)}}
        send(json.dumps({"jsonrpc": "2.0", **note}, separators=(",", ":")))
    if kind == "odd":
        odd = float("inf") if args.get("odd") == "inf" else "x" * 20_001
        rows: list[object] = [{"k": j % 10} for j in range(n)]
        result = {"content": text, "structuredContent": {"rows": rows, "z": odd}}
    elif kind == "lists":
        result = {"content": text, "structuredContent": lists(n)}
    elif kind == "long":
        result = {"content": text, "structuredContent": {"s": "ab" * n + "a"}}
    elif kind == "meta":
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


def ask(method: str, pad: int) -> str:
    """A server request `method` whose text is `pad` characters long."""
    if method == "sampling/createMessage":
        text = {"type": "text", "text": "p" * pad}
        params: dict[str, object] = {
            "messages": [{"role": "user", "content": text}],
            "maxTokens": 5,
        }
    else:
        params = {"message": "p" * pad, "requestedSchema": {"type": "object", "properties": {}}}
    return json.dumps({"jsonrpc": "2.0", "id": 555, "method": method, "params": params})


def main() -> None:
    tool: dict[str, object] = {
        "name": "go",
        "description": "answer",
        "inputSchema": {"type": "object"},
    }
    if "--pattern" in sys.argv:  # checked by the client, on RE2, against a string `s`
        pattern = {"type": "string", "pattern": sys.argv[sys.argv.index("--pattern") + 1]}
        tool["inputSchema"] = {"type": "object", "properties": {"s": pattern}}
        if "--patterns" in sys.argv:
            n = int(sys.argv[sys.argv.index("--patterns") + 1])
            by_pattern = {f"(?:{i})" + pattern["pattern"]: {} for i in range(n)}
            tool["inputSchema"] = {"type": "object", "patternProperties": by_pattern}
        if "--output-pattern" in sys.argv:
            tool["outputSchema"] = {"type": "object", "properties": {"s": pattern}}
    if "--output-schema" in sys.argv:
        entry = {"type": "object", "properties": {"k": {"type": "integer", "maximum": 8}}}
        items = {"type": "array", "items": entry}
        tool["outputSchema"] = {"type": "object", "properties": {"b": items}}
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
            more = [{"name": f"t{i}", "inputSchema": tool["inputSchema"]} for i in range(TOOLS)]
            result = {"tools": [tool, *more]}
        elif method == "tools/call":
            arguments = message["params"].get("arguments") or {}
            if arguments.get("kind") == "ask":  # a server request; the client's reply is the text
                send(ask(arguments["method"], int(arguments.get("pad", 10))))
                reply = json.loads(sys.stdin.readline())
                text = json.dumps(reply.get("error") or reply.get("result"))
                result = {"content": [{"type": "text", "text": text}]}
                send(json.dumps({"jsonrpc": "2.0", "id": call_id, "result": result}))
                continue
            send(answer(call_id, arguments))
            continue
        else:
            result = {}
        if call_id is not None:
            send(json.dumps({"jsonrpc": "2.0", "id": call_id, "result": result}))


if __name__ == "__main__":
    main()
