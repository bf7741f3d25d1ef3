"""The remeasurements table: the finalists of a problem, measured again after its search.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-24

A new table beside tuning_trials, whose rows stay as they are (a trial keeps its first
measurement). Downgrading drops the table and with it every re-measurement; the best_configs
rows keep the medians they were given until their next refresh.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy of the trial statuses at this revision (the models may grow later ones).
TRIAL_STATUSES = ("ok", "invalid", "compile_error", "runtime_error", "wrong_result", "timeout")


def _one_of(column: str, values: Sequence[str]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def upgrade() -> None:
    op.create_table(
        "remeasurements",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("trial_id", sa.Integer(), sa.ForeignKey("tuning_trials.id"), nullable=False),
        sa.Column("sweep_id", sa.Integer(), sa.ForeignKey("sweeps.id"), nullable=True),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("median_ms", sa.Float(), nullable=True),
        sa.Column("tflops", sa.Float(), nullable=True),
        sa.Column("error", sa.Float(), nullable=True),
        sa.Column("worker", sa.String(200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(_one_of("status", TRIAL_STATUSES), name="ck_remeasurements_status"),
    )
    for column in ("trial_id", "sweep_id"):
        op.create_index(f"ix_remeasurements_{column}", "remeasurements", [column])


def downgrade() -> None:
    op.drop_table("remeasurements")
