"""The adapter contract suite: one set of cases run against every platform adapter.

Layout: ``harnesses.py`` holds one harness per adapter and THE parameter table
``HARNESSES`` (one entry per adapter); ``proxy.py`` is the fault-injecting HTTP
proxy every HTTP harness puts in front of its server; ``conftest.py``
parametrises every case over the table; the cases are one module per concern:
``test_identity.py`` (whoami, made by kind, resolve, settings errors, no
secret in errors, logs or repr),
``test_send.py`` (created, lost answer, unreadable answer, refused connection,
refusal, rate limit, 5xx), ``test_read_back.py`` (found, not found, partial,
failed), ``test_delete.py`` (gone = done), ``test_paging.py`` (inbox and search
cursors), ``test_guard_flow.py`` (the guard and the sweep over the adapter:
three paths one reply, lost answer closed by the sweep, 5xx then one more
attempt, reworded retry, crash between send and close).

Adding a platform to the suite: write a ``Harness`` subclass (how to build the
adapter, make a parent, inject a fault, count the bot's replies on the
platform's side), add one ``Entry`` to ``HARNESSES``, and list in its
``skips`` (with the reason) any case that cannot apply; a case it fails today
goes in ``known_bugs`` (a strict xfail) until the adapter is fixed.

Run: ``pytest tests/contract`` (``-k mastodon`` for one adapter).
"""
