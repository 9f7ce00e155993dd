"""Platform adapters: ``base`` holds the contract, ``_http`` the shared HTTP base, one module per platform.

Importing the package registers every adapter module in it (before a daemon starts serving, not on its
first bot).
"""

from replyd.platforms.base import _load_builtin

_load_builtin()
