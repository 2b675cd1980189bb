"""Tools from Model Context Protocol servers (the `treadle[mcp]` extra, on the official SDK).

```python
from treadle.mcp import MCPServer

time_server = MCPServer.stdio("mcp-server-time")
out = run_session_loop(user, agent, agent_provider=provider, tools=time_server.tools())
```

`treadle` never imports this package (nor the `mcp` SDK) by itself: import it to use it. The SDK
itself (most of a second to import) loads when a name below is first used, not at
`import treadle.mcp`; a missing SDK is reported at the import.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

if importlib.util.find_spec("mcp") is None:  # pragma: no cover - exercised without the extra
    raise ImportError("treadle.mcp needs the MCP SDK; install it with: pip install 'treadle[mcp]'")

if TYPE_CHECKING:
    from treadle.mcp.server import DEFAULT_CALL_TIMEOUT as DEFAULT_CALL_TIMEOUT
    from treadle.mcp.server import DEFAULT_CONNECT_TIMEOUT as DEFAULT_CONNECT_TIMEOUT
    from treadle.mcp.server import DEFAULT_MAX_CONCURRENCY as DEFAULT_MAX_CONCURRENCY
    from treadle.mcp.server import DEFAULT_PING_TIMEOUT as DEFAULT_PING_TIMEOUT
    from treadle.mcp.server import MCPServer as MCPServer
    from treadle.mcp.server import atools_from as atools_from
    from treadle.mcp.server import tools_from as tools_from
    from treadle.mcp.stdio import DEFAULT_MAX_MESSAGE_BYTES as DEFAULT_MAX_MESSAGE_BYTES
    from treadle.mcp.tool import MCPTool as MCPTool

# Public name -> the module defining it, imported on first access (PEP 562).
_EXPORTS = {
    "DEFAULT_CALL_TIMEOUT": "treadle.mcp.server",
    "DEFAULT_CONNECT_TIMEOUT": "treadle.mcp.server",
    "DEFAULT_MAX_CONCURRENCY": "treadle.mcp.server",
    "DEFAULT_PING_TIMEOUT": "treadle.mcp.server",
    "MCPServer": "treadle.mcp.server",
    "atools_from": "treadle.mcp.server",
    "tools_from": "treadle.mcp.server",
    "DEFAULT_MAX_MESSAGE_BYTES": "treadle.mcp.stdio",
    "MCPTool": "treadle.mcp.tool",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'treadle.mcp' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
