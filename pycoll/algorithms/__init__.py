"""Collective algorithms, written against Channel only (no sockets, no transports)."""
