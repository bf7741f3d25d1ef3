"""The head_to_heads and head_to_head_readings tables: the best configs of a problem's
implementations measured side by side at the end of a sweep.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-26

New tables; no row of the others changes. Downgrading drops them and every side-by-side
reading with them; the best_configs rows keep the times they were given until their next
refresh, which then goes back to the sweep's own readings.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy of the trial statuses at this revision (the models may grow later ones).
TRIAL_STATUSES = ("ok", "invalid", "compile_error", "runtime_error", "wrong_result", "timeout")


def upgrade() -> None:
    op.create_table(
        "head_to_heads",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("device_id", sa.Integer(), sa.ForeignKey("devices.id"), nullable=False),
        sa.Column("sweep_id", sa.Integer(), sa.ForeignKey("sweeps.id"), nullable=True),
        sa.Column("problem", sa.JSON(), nullable=False),
        sa.Column("rounds", sa.Integer(), nullable=False),
        sa.Column("worker", sa.String(200), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
    )
    for column in ("device_id", "sweep_id"):
        op.create_index(f"ix_head_to_heads_{column}", "head_to_heads", [column])
    op.create_table(
        "head_to_head_readings",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("head_to_head_id", sa.Integer(), sa.ForeignKey("head_to_heads.id"),
                  nullable=False),
        sa.Column("trial_id", sa.Integer(), sa.ForeignKey("tuning_trials.id"), nullable=False),
        sa.Column("round", sa.Integer(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("median_ms", sa.Float(), nullable=True),
        sa.Column("tflops", sa.Float(), nullable=True),
        sa.Column("error", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(f"status IN ({', '.join(repr(s) for s in TRIAL_STATUSES)})",
                           name="ck_head_to_head_readings_status"),
    )
    for column in ("head_to_head_id", "trial_id"):
        op.create_index(f"ix_head_to_head_readings_{column}", "head_to_head_readings", [column])


def downgrade() -> None:
    op.drop_table("head_to_head_readings")
    op.drop_table("head_to_heads")
