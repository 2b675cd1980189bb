"""Tools from Model Context Protocol servers (the `treadle[mcp]` extra, on the official SDK).

```python
from treadle.mcp import MCPServer

time_server = MCPServer.stdio("mcp-server-time")
out = run_session_loop(user, agent, agent_provider=provider, tools=time_server.tools())
```

`treadle` never imports this package (nor the `mcp` SDK) by itself: import it to use it.
"""

try:
    import mcp as _sdk  # noqa: F401  (checked here so the error names the extra)
except ImportError as error:  # pragma: no cover - exercised without the extra installed
    raise ImportError(
        "treadle.mcp needs the MCP SDK; install it with: pip install 'treadle[mcp]'"
    ) from error

from treadle.mcp.server import (
    DEFAULT_CALL_TIMEOUT,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_MAX_CONCURRENCY,
    DEFAULT_PING_TIMEOUT,
    MCPServer,
    atools_from,
    tools_from,
)
from treadle.mcp.stdio import DEFAULT_MAX_MESSAGE_BYTES
from treadle.mcp.tool import MCPTool

__all__ = [
    "DEFAULT_CALL_TIMEOUT",
    "DEFAULT_CONNECT_TIMEOUT",
    "DEFAULT_MAX_CONCURRENCY",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "DEFAULT_PING_TIMEOUT",
    "MCPServer",
    "MCPTool",
    "atools_from",
    "tools_from",
]
