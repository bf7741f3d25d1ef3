"""The snapshots table: best configs frozen as one bundle, named by the hash of its content.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-26

A new table (``db.models.Snapshot``), independent of the others: rows are only inserted.
Downgrading drops it, and the snapshots with it: export those to keep first
(``tuner export --snapshot ID``).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "snapshots",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("content", sa.Text(), nullable=False),
        sa.Column("items", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_snapshots_created_at", "snapshots", ["created_at"])


def downgrade() -> None:
    op.drop_table("snapshots")
