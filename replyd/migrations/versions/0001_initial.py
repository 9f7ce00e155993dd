"""The answered-log, its events and poller cursors.

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create replies, events and cursors."""
    op.create_table(
        "replies",
        sa.Column("platform", sa.String(255), primary_key=True),
        sa.Column("sender_id", sa.String(255), primary_key=True),
        sa.Column("parent_id", sa.String(1024), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
        sa.Column("opened_at", sa.Float(), nullable=True),
        sa.Column("deadline_at", sa.Float(), nullable=True),
        sa.Column("closed_at", sa.Float(), nullable=True),
        sa.Column("not_before", sa.Float(), nullable=True),
        sa.Column("reply_id", sa.String(1024), nullable=True),
        sa.Column("provider_key", sa.String(255), nullable=True),
        sa.Column("text_hash", sa.String(64), nullable=True),
        sa.Column("path", sa.String(64), nullable=False),
        sa.Column("snapshot", sa.Text(), nullable=False),
        sa.Column("owner", sa.String(255), nullable=True),
        sa.Column("lease_owner", sa.String(255), nullable=True),
        sa.Column("lease_until", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
    )
    op.create_index("ix_replies_due", "replies", ["state", "deadline_at"])
    op.create_table(
        "events",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("at", sa.Float(), nullable=False),
        sa.Column("platform", sa.String(255), nullable=False),
        sa.Column("sender_id", sa.String(255), nullable=False),
        sa.Column("parent_id", sa.String(1024), nullable=False),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("state", sa.String(16), nullable=True),
        sa.Column("attempt", sa.Integer(), nullable=True),
        sa.Column("owner", sa.String(255), nullable=True),
        sa.Column("detail", sa.Text(), nullable=False),
    )
    op.create_index("ix_events_key", "events", ["platform", "sender_id", "parent_id"])
    op.create_index("ix_events_at", "events", ["at"])
    op.create_table(
        "cursors",
        sa.Column("platform", sa.String(255), primary_key=True),
        sa.Column("sender_id", sa.String(255), primary_key=True),
        sa.Column("name", sa.String(255), primary_key=True),
        sa.Column("value", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    """Drop everything (loses the log: only for tests)."""
    op.drop_table("cursors")
    op.drop_table("events")
    op.drop_table("replies")
