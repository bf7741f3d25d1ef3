"""The remeasurement_claims table: which worker is re-measuring which finalist right now.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-24

A new table; rows live only while a re-measurement runs (``db.models.RemeasurementClaim``).
Downgrading drops it: workers of the older release take no claims.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "remeasurement_claims",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("trial_id", sa.Integer(), sa.ForeignKey("tuning_trials.id"), nullable=False),
        sa.Column("worker", sa.String(200), nullable=False),
        sa.Column("beat_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_remeasurement_claims_trial_id", "remeasurement_claims", ["trial_id"])


def downgrade() -> None:
    op.drop_table("remeasurement_claims")
