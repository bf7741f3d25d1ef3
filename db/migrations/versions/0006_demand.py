"""The demand table: problems jobs ran without a tuned config, and the workers tuning them.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-25

A new table, not tied to the others by foreign keys: a job reports its device by key, and a
device that nothing was tuned for has no row in ``devices`` (``db.models.Demand``).
Downgrading drops it and every count with it; tuned configs are untouched.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy of the demand statuses at this revision (the models may grow later ones).
DEMAND_STATUSES = ("open", "claimed", "done", "failed")


def upgrade() -> None:
    op.create_table(
        "demand",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("device_key", sa.String(400), nullable=False),
        sa.Column("template", sa.String(100), nullable=False),
        sa.Column("template_version", sa.String(64), nullable=False),
        sa.Column("problem_key", sa.String(300), nullable=False),
        sa.Column("problem", sa.JSON(), nullable=False),
        sa.Column("reports", sa.BigInteger(), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("worker", sa.String(200), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("claimed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lease_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("note", sa.Text(), nullable=False),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("device_key", "template", "template_version", "problem_key"),
        sa.CheckConstraint(f"status IN ({', '.join(repr(s) for s in DEMAND_STATUSES)})",
                           name="ck_demand_status"),
    )
    op.create_index("ix_demand_device_status", "demand", ["device_key", "status"])


def downgrade() -> None:
    op.drop_table("demand")
