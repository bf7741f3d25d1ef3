"""The best_changes counter: changes of best configs, devices and templates, counted by
triggers on SQLite (``db.models.BestChanges``).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27

A new one-row table; on SQLite nine triggers (insert, update, delete on best_configs, devices
and templates) add one to it for every row they touch. No row of the other tables changes.
Downgrading drops the triggers and the table: the service then takes every commit as a
change again.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copy of the watched tables and the triggers at this revision.
WATCHED = ("best_configs", "devices", "templates")
OPERATIONS = ("insert", "update", "delete")


def upgrade() -> None:
    table = op.create_table(
        "best_changes",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("changes", sa.BigInteger(), nullable=False),
    )
    op.bulk_insert(table, [{"id": 1, "changes": 0}])
    if op.get_bind().dialect.name == "sqlite":
        for watched in WATCHED:
            for operation in OPERATIONS:
                op.execute(f"CREATE TRIGGER best_changes_{watched}_{operation} AFTER "
                           f"{operation.upper()} ON {watched} BEGIN UPDATE best_changes SET "
                           f"changes = changes + 1 WHERE id = 1; END")


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        for watched in WATCHED:
            for operation in OPERATIONS:
                op.execute(f"DROP TRIGGER IF EXISTS best_changes_{watched}_{operation}")
    op.drop_table("best_changes")
