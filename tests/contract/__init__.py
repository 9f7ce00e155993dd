"""The adapter contract suite: one set of cases run against every platform adapter (see harnesses.py)."""
