"""Built-in platform adapters; importing this package registers them by kind."""

from replyd.platforms import memory  # noqa: F401
from replyd.platforms import mastodon  # noqa: F401
from replyd.platforms import discourse, github  # noqa: F401
from replyd.platforms import bluesky  # noqa: F401
from replyd.platforms import matrix  # noqa: F401
from replyd.platforms import slack  # noqa: F401
