"""Reply policy: the parent's author on each row, and an index for per-hour caps.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Add replies.author_id and the (platform, sender_id, opened_at) index the caps count on."""
    with op.batch_alter_table("replies") as batch:
        batch.add_column(sa.Column("author_id", sa.String(255), nullable=True))
    op.create_index("ix_replies_opened", "replies", ["platform", "sender_id", "opened_at"])


def downgrade() -> None:
    """Drop the index and the column."""
    op.drop_index("ix_replies_opened", table_name="replies")
    with op.batch_alter_table("replies") as batch:
        batch.drop_column("author_id")
