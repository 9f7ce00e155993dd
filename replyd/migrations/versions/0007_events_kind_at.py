"""Events by kind and time: the page's last-hour answers read one index range, not every close ever made.

The composite index replaces ``ix_events_kind``: its kind prefix serves every query that one served.

Revision ID: 0007
Revises: 0006
"""

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Index events on (kind, at) in place of kind alone."""
    op.create_index("ix_events_kind_at", "events", ["kind", "at"])
    op.drop_index("ix_events_kind", table_name="events")


def downgrade() -> None:
    """Back to the index on kind alone."""
    op.create_index("ix_events_kind", "events", ["kind"])
    op.drop_index("ix_events_kind_at", table_name="events")
