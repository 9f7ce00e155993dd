"""Observed listing lag per platform instance, and the listing delay each instance uses.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create listing_lag (one sample per own reply whose send time is known) and listing_delay."""
    op.create_table(
        "listing_lag",
        sa.Column("platform", sa.String(255), primary_key=True),
        sa.Column("reply_id", sa.String(1024), primary_key=True),
        sa.Column("sender_id", sa.String(255), nullable=False),
        sa.Column("sent_at", sa.Float(), nullable=False),
        sa.Column("lower_s", sa.Float(), nullable=False),
        sa.Column("upper_s", sa.Float(), nullable=True),
        sa.Column("seen_at", sa.Float(), nullable=True),
    )
    op.create_index("ix_listing_lag_seen", "listing_lag", ["platform", "seen_at"])
    op.create_table(
        "listing_delay",
        sa.Column("platform", sa.String(255), primary_key=True),
        sa.Column("configured_s", sa.Float(), nullable=False),
        sa.Column("in_use_s", sa.Float(), nullable=False),
        sa.Column("updated_at", sa.Float(), nullable=False),
    )


def downgrade() -> None:
    """Drop both tables."""
    op.drop_table("listing_delay")
    op.drop_index("ix_listing_lag_seen", table_name="listing_lag")
    op.drop_table("listing_lag")
