"""Answers in several parts: the composed parts stored before the first part leaves (replyd.parts).

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create answers (one row per answer sent in parts: its parts' texts as a JSON list)."""
    op.create_table(
        "answers",
        sa.Column("platform", sa.String(255), primary_key=True),
        sa.Column("sender_id", sa.String(255), primary_key=True),
        sa.Column("parent_id", sa.String(1024), primary_key=True),
        sa.Column("parts", sa.Text(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    """Drop the table."""
    op.drop_table("answers")
