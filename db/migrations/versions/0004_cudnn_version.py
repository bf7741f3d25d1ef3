"""devices.cudnn_version: the cuDNN version, part of the device's identity (its key).

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-24

A nullable column. Rows stored before it stay NULL: their cuDNN is unknown, and their keys
(which have no cuDNN part) are left as they are, so they never match a device whose key has
one (docs/DISPATCH.md, "The device key"). Downgrading drops the column; the keys of devices
stored with a cuDNN version keep their cuDNN part, which no key of an older release has: their
measurements stay apart from what the older release measures, as they should.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | Sequence[str] | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("devices", sa.Column("cudnn_version", sa.String(64), nullable=True))


def downgrade() -> None:
    # In place, also on SQLite (3.35 and later drop an unindexed column): a batch rebuild
    # (copy, drop, rename) cannot drop a table that other tables' foreign keys reference
    # while db.session enforces them.
    op.drop_column("devices", "cudnn_version")
