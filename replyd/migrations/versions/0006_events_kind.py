"""Events by kind: the duplicates counted per bot for status and metrics read one index, not the whole table.

Revision ID: 0006
Revises: 0005
"""

from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Index events on kind."""
    op.create_index("ix_events_kind", "events", ["kind"])


def downgrade() -> None:
    """Drop the index."""
    op.drop_index("ix_events_kind", table_name="events")
