"""The fake MCP server's tools over stdio, for tests/test_mcp.py (a stdio
command as a toolset's server)."""

from oncely.fakes.mcp import MCPState, make_server

if __name__ == "__main__":
    make_server(MCPState()).run("stdio")
