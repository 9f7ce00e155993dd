"""The fleet: replicas' heartbeats and bot leases (one replica runs a bot's discovery at a time).

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    """Create replicas and bot_leases."""
    op.create_table(
        "replicas",
        sa.Column("owner", sa.String(255), primary_key=True),
        sa.Column("heartbeat_at", sa.Float(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
    )
    op.create_table(
        "bot_leases",
        sa.Column("bot", sa.String(255), primary_key=True),
        sa.Column("holder", sa.String(255), nullable=True),
        sa.Column("until", sa.Float(), nullable=False),
        sa.Column("wanted_by", sa.String(255), nullable=True),
    )


def downgrade() -> None:
    """Drop both tables."""
    op.drop_table("bot_leases")
    op.drop_table("replicas")
