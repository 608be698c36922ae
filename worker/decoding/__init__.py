"""Fetched bytes → upright RGB pages: format sniffing, PDF rendering, and decoding in supervised
child processes (a crashing decoder costs one image, never the worker)."""
