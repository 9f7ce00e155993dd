"""Alembic environment: replyd passes its own connection in ``config.attributes``."""

from alembic import context

from replyd.store.schema import METADATA

target_metadata = METADATA
connection = context.config.attributes.get("connection")
if connection is None:  # pragma: no cover - replyd always passes a connection
    raise RuntimeError("replyd migrations run through `replyd db upgrade`, not the alembic CLI")

context.configure(
    connection=connection,
    target_metadata=target_metadata,
    render_as_batch=connection.dialect.name == "sqlite",
    transaction_per_migration=True,
)
with context.begin_transaction():
    context.run_migrations()
