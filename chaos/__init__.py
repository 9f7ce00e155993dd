"""Chaos runs for replyd: real daemon processes against the simulated platform with injected faults.

Nothing here is part of replyd: the runner starts ``python -m replyd run`` as
ordinary OS processes, talks to them only through the platform (the sim, over
real HTTP), the database and signals, and counts what landed on the platform
side. See ``docs/RELIABILITY.md`` for what is injected and ``docs/CAMPAIGNS.md`` for what was measured.

Entry point: ``python -m chaos --runs N --seed S`` (``--short`` for the
version that runs inside ``make test``). The last line of stdout is one JSON
object with the totals.
"""
