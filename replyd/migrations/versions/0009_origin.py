"""Who sent a parent when the answer goes elsewhere: replies.origin_id, counted by the per-author caps too.

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add replies.origin_id, NULL on every existing row (its author is its only sender)."""
    with op.batch_alter_table("replies") as batch:
        batch.add_column(sa.Column("origin_id", sa.String(255), nullable=True))


def downgrade() -> None:
    """Drop the column."""
    with op.batch_alter_table("replies") as batch:
        batch.drop_column("origin_id")
