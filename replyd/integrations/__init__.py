"""Wiring for other projects' bots (docs/INTEGRATIONS.md); each module imports its project only when called."""
