"""Platform adapters: ``base`` holds the contract, ``_http`` the shared HTTP base, one module per platform.

The built-in adapters register on import; ``base.make_platform`` imports them when first asked.
"""
