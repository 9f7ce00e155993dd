"""replyd: answer each post, thread or ticket exactly once."""

__version__ = "0.1.0"
