"""tuning_trials.phases, remeasurements.phases, head_to_head_readings.phases: where each
measurement's worker time went.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-28

A nullable JSON column on each table of measurements: the seconds of each phase of the trial
in the worker (making the inputs, the first launch, the reference, the check, the timing;
``tuner.tuning.runner.outcome.TrialOutcome.phase_record``), the worker's whole time, and
whether the reference was the worker's kept one. Rows stored before it stay NULL: their
phases were not recorded. Downgrading drops the columns, and with them the phases; every
other value of the rows stays.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | Sequence[str] | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy of the tables of measurements at this revision.
TABLES = ("tuning_trials", "remeasurements", "head_to_head_readings")


def upgrade() -> None:
    for table in TABLES:
        op.add_column(table, sa.Column("phases", sa.JSON(), nullable=True))


def downgrade() -> None:
    # In place, also on SQLite (3.35 and later drop an unindexed column), as 0004's: a batch
    # rebuild cannot drop a table that other tables' foreign keys reference.
    for table in TABLES:
        op.drop_column(table, "phases")
