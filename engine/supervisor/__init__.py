"""The supervisor of a line: its loop, children, socket server, RPC, discovery, notices."""
