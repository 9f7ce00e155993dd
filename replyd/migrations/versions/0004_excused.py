"""Attempts an outage swallowed: replies.excused (not counted against max_attempts).

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add replies.excused, 0 on every existing row."""
    with op.batch_alter_table("replies") as batch:
        batch.add_column(sa.Column("excused", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    """Drop the column."""
    with op.batch_alter_table("replies") as batch:
        batch.drop_column("excused")
