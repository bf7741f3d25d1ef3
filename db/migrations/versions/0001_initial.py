"""The five tables of the project: devices, templates, sweeps, tuning_trials, best_configs.

Revision ID: 0001
Revises:
Create Date: 2026-11-23

Statuses are stored as their text values; the CHECK constraints keep rows written by other
tools to the known ones (a new status needs a migration that widens the check).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# Frozen copies of the enum values at this revision (the models may grow later ones).
TRIAL_STATUSES = ("ok", "invalid", "compile_error", "runtime_error", "wrong_result", "timeout")
SWEEP_STATUSES = ("running", "done", "failed", "interrupted")


def _one_of(column: str, values: Sequence[str]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _timestamp(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "devices",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("key", sa.String(400), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("compute_capability", sa.String(16), nullable=False),
        sa.Column("sm_count", sa.Integer(), nullable=False),
        sa.Column("total_memory", sa.BigInteger(), nullable=False),
        sa.Column("driver_version", sa.String(64), nullable=False),
        sa.Column("triton_version", sa.String(64), nullable=False),
        sa.Column("torch_version", sa.String(64), nullable=False),
        sa.Column("cuda_version", sa.String(64), nullable=False),
        _timestamp("created_at"),
        sa.UniqueConstraint("key", name="devices_key_key"),
    )
    op.create_index("ix_devices_name", "devices", ["name"])

    op.create_table(
        "templates",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("version", sa.String(64), nullable=False),
        sa.Column("space", sa.JSON(), nullable=False),
        _timestamp("created_at"),
        sa.UniqueConstraint("name", "version", name="templates_name_version_key"),
    )
    op.create_index("ix_templates_name", "templates", ["name"])

    op.create_table(
        "sweeps",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("spec", sa.JSON(), nullable=False),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        _timestamp("started_at"),
        _timestamp("finished_at", nullable=True),
        sa.CheckConstraint(_one_of("status", SWEEP_STATUSES), name="ck_sweeps_status"),
    )
    op.create_index("ix_sweeps_name", "sweeps", ["name"])

    op.create_table(
        "tuning_trials",  # "trials" is Optuna's, in the same database
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("sweep_id", sa.Integer(), sa.ForeignKey("sweeps.id"), nullable=True),
        sa.Column("device_id", sa.Integer(), sa.ForeignKey("devices.id"), nullable=False),
        sa.Column("template_id", sa.Integer(), sa.ForeignKey("templates.id"), nullable=False),
        sa.Column("problem_key", sa.String(300), nullable=False),
        sa.Column("problem", sa.JSON(), nullable=False),
        sa.Column("config_key", sa.String(500), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(20), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("median_ms", sa.Float(), nullable=True),
        sa.Column("tflops", sa.Float(), nullable=True),
        sa.Column("compile_s", sa.Float(), nullable=True),
        sa.Column("error", sa.Float(), nullable=True),
        sa.Column("is_default", sa.Boolean(), nullable=False),
        sa.Column("optuna_study", sa.String(500), nullable=True),
        sa.Column("optuna_trial", sa.Integer(), nullable=True),
        sa.Column("worker", sa.String(200), nullable=False),
        _timestamp("created_at"),
        sa.UniqueConstraint("device_id", "template_id", "problem_key", "config_key",
                            name="tuning_trials_device_id_template_id_problem_key_config_key_key"),
        sa.CheckConstraint(_one_of("status", TRIAL_STATUSES), name="ck_tuning_trials_status"),
    )
    for column in ("sweep_id", "device_id", "template_id", "problem_key"):
        op.create_index(f"ix_tuning_trials_{column}", "tuning_trials", [column])

    op.create_table(
        "best_configs",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("device_id", sa.Integer(), sa.ForeignKey("devices.id"), nullable=False),
        sa.Column("template_id", sa.Integer(), sa.ForeignKey("templates.id"), nullable=False),
        sa.Column("problem_key", sa.String(300), nullable=False),
        sa.Column("problem", sa.JSON(), nullable=False),
        sa.Column("dtype", sa.String(20), nullable=False),
        sa.Column("variant", sa.String(100), nullable=False),
        sa.Column("config", sa.JSON(), nullable=False),
        sa.Column("median_ms", sa.Float(), nullable=False),
        sa.Column("tflops", sa.Float(), nullable=False),
        sa.Column("default_tflops", sa.Float(), nullable=True),
        sa.Column("speedup", sa.Float(), nullable=True),
        sa.Column("trial_id", sa.Integer(), sa.ForeignKey("tuning_trials.id"), nullable=True),
        sa.Column("sweep_id", sa.Integer(), sa.ForeignKey("sweeps.id"), nullable=True),
        _timestamp("updated_at"),
        sa.UniqueConstraint("device_id", "template_id", "problem_key",
                            name="best_configs_device_id_template_id_problem_key_key"),
    )
    for column in ("device_id", "template_id", "problem_key", "dtype", "variant"):
        op.create_index(f"ix_best_configs_{column}", "best_configs", [column])


def downgrade() -> None:
    # Children first; Optuna's tables are not ours and stay.
    for table in ("best_configs", "tuning_trials", "sweeps", "templates", "devices"):
        op.drop_table(table)
