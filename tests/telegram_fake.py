"""The Telegram Bot API fake, now ``replyd.sim.telegram`` (the docs' examples use it); re-exported for the tests."""

from replyd.sim.telegram import (  # noqa: F401
    BOT_ID,
    BOT_USERNAME,
    FIXTURES,
    KEEP_S,
    MAX_TEXT,
    TOKEN,
    Chat,
    TelegramApi,
    TelegramWorld,
    WebhookSender,
    fixture,
    utf16_len,
)
