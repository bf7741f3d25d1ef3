"""What a new user hit with the ``tuner`` command (issue 41, "What a new user hit"): a slow
start on every command and error, a traceback for a bad list variable, typos that answer
"nothing stored", boxed tables ~270 columns wide when piped."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from rich.table import Table

from tests.tuner.cli.test_sweep_cli import cli
from tests.tuner.piped_table import piped_table
from tuner.cli.common import plain_table, print_table
from tuner.settings import get_settings

ROOT = Path(__file__).resolve().parents[3]
# What made `tuner --help` take 10-12 s: torch and the kernels (triton), and the libraries of
# the commands that need them. A command imports them when it runs.
HEAVY = ("torch", "triton", "sqlalchemy", "optuna", "httpx", "fastapi", "uvicorn", "numpy")
SCRIPT = """
import json, sys
from tuner.cli.app import main
codes = []
for args in json.loads(sys.argv[1]):
    try:
        main(args)
    except SystemExit as exc:
        codes.append(exc.code)
heavy = [m for m in HEAVY if m in sys.modules]
print(json.dumps({"codes": codes, "heavy": heavy}), file=sys.__stdout__)
"""


def run_cli_many(*commands: list[str], **env: str) -> tuple[dict[str, Any], str]:
    """``tuner ARGS`` for each of ``commands``, one after the other in one fresh process:
    their exit codes and the heavy modules they imported together."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TUNER_")}
    environ.update(PYTHONPATH=str(ROOT), **env)
    done = subprocess.run([sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{SCRIPT}",
                           json.dumps(commands)],
                          env=environ, capture_output=True, text=True, timeout=120, cwd=ROOT)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def run_cli(*args: str, **env: str) -> tuple[dict[str, Any], str]:
    """``tuner ARGS`` in a fresh process: its exit code and the heavy modules it imported."""
    result, err = run_cli_many(list(args), **env)
    return {"code": result["codes"][0], "heavy": result["heavy"]}, err


@pytest.fixture(autouse=True)
def fresh_settings() -> None:
    get_settings.cache_clear()


def test_help_imports_no_heavy_library() -> None:
    # Item 1: `tuner --help` took 10-12 s, importing torch and triton; it now takes 0.7 s on
    # the 2-core CPU machine (measured with `time tuner --help`).
    commands = [["--help"], *([name, "--help"] for name in (
        "sweep", "best", "verify", "compile-check", "list", "export", "import", "replay",
        "serve", "winners", "worker", "db", "snapshot"))]
    result, err = run_cli_many(*commands)
    assert result == {"codes": [0] * len(commands), "heavy": []}, err


@pytest.mark.parametrize("args", [
    ["sweep"], ["sweep", "quick", "--shape", "B=1,H=1,N=16,D=16"], ["best", "--limit", "0"],
    ["verify", "--causal", "top_left"], ["list", "nothing"], ["no-such-command"]])
def test_an_error_of_the_flags_alone_imports_no_torch(args: list[str]) -> None:
    # Item 1: "error paths too". Errors that need the kernels (a typo in --dtype, checked
    # against the registered templates) come when the command has imported them.
    result, err = run_cli(*args)
    assert result["code"] == 2, err
    assert not {"torch", "triton", "optuna"} & set(result["heavy"]), err  # type: ignore[arg-type]


def test_a_list_variable_that_is_not_json_is_an_error_with_a_fix() -> None:
    # Item 3: TUNER_TEMPLATE_MODULES=notjson printed a 179-line traceback, rc 1.
    result, err = run_cli("list", "templates", TUNER_TEMPLATE_MODULES="notjson")
    assert result["code"] == 2, err
    assert not {"torch", "triton"} & set(result["heavy"])  # 0.7 s, as --help
    assert "Traceback" not in err
    assert "error: bad configuration: TUNER_TEMPLATE_MODULES: is not a JSON list" in err
    assert 'write it as ["a", "b"]' in err
    assert "fix: correct or unset TUNER_TEMPLATE_MODULES" in err


def test_a_bad_tuner_shipped_names_what_is_allowed() -> None:
    result, err = run_cli("list", "templates", TUNER_SHIPPED="offf")
    assert result["code"] == 2 and "Traceback" not in err, err
    assert ("error: bad configuration: TUNER_SHIPPED: Value error, must be on, off or the path "
            "of a folder of shipped tables") in err and "but got 'offf'" in err
    assert "fix: correct or unset TUNER_SHIPPED" in err


@pytest.mark.parametrize(("args", "wrong", "fix"), [
    (["best", "--dtype", "fp16"], "--dtype must be one of float16, bfloat16, float32, "
                                  "but got 'fp16'", "did you mean --dtype float16?"),
    (["winners", "--dtype", "fp16"], "--dtype must be one of float16, bfloat16, float32, "
                                     "but got 'fp16'", "did you mean --dtype float16?"),
    (["best", "--variant", "densee"], "--variant must be dense, causal-<mode>",
     "did you mean --variant dense?"),
    (["best", "--template", "flash_fwdd"], "no template 'flash_fwdd' is registered or stored",
     "did you mean --template flash_fwd?"),
])
def test_a_typo_in_a_filter_is_an_error_not_an_empty_answer(
        args: list[str], wrong: str, fix: str, tmp_path: Path) -> None:
    # Item 4: the typo was accepted and answered with "no best configs stored", rc 0.
    code, out, err = cli(*args, "--db", f"sqlite:///{tmp_path / 'x.db'}", "--json")
    assert code == 2, out + err
    error = json.loads(out)
    assert wrong in error["error"]
    assert error["fix"] == fix


def _variant(causal: str = "none", mask: str = "none", softcap: float = 0.0) -> str:
    from templates.base import Problem

    return Problem(1, 2, 2, 64, 64, 64, "float16", causal, mask=mask, softcap=softcap).variant


@pytest.mark.parametrize("variant", [
    _variant(), _variant("top_left"), _variant("bottom_right"), _variant(mask="random:0.10"),
    _variant("top_left", "sliding:64"), _variant(softcap=50.0),
    _variant("top_left", softcap=30.0), _variant("top_left", "sliding:64", softcap=0.5),
    _variant(mask="document:4", softcap=1e6)])
def test_every_variant_a_problem_has_is_accepted(variant: str, tmp_path: Path) -> None:
    code, out, err = cli("best", "--variant", variant, "--db", f"sqlite:///{tmp_path / 'x.db'}",
                         "--json")
    assert (code, json.loads(out)) == (0, []), err


@pytest.mark.parametrize("variant", ["dense+softcap50", "softcap", "causal-top_left+softcapx",
                                     "softcap50+causal-top_left"])
def test_a_softcap_variant_out_of_order_is_refused(variant: str, tmp_path: Path) -> None:
    code, out, _ = cli("best", "--variant", variant, "--db", f"sqlite:///{tmp_path / 'x.db'}",
                       "--json")
    assert code == 2 and "+softcap<cap>" in json.loads(out)["error"], out


def test_a_template_stored_but_not_registered_here_is_accepted(tmp_path: Path) -> None:
    from db import crud
    from db.session import session_scope

    url = f"sqlite:///{tmp_path / 'x.db'}"
    with session_scope(url) as s:
        crud.get_or_create_template(s, name="their_kernel", version="v1", space={})
    code, out, err = cli("best", "--template", "their_kernel", "--db", url, "--json")
    assert (code, json.loads(out)) == (0, []), err


@pytest.mark.slow  # 20 s: a sweep in a fresh process under the interpreter
@pytest.mark.timeout(300)
def test_sigterm_stops_a_sweep_as_ctrl_c_does(tmp_path: Path) -> None:
    # Item 5: `kill -TERM` of a sweep exited 143 with no message and left it `running` in
    # `tuner list sweeps` for good; Ctrl-C marks it interrupted and says how to resume.
    import signal
    import time

    from db import crud
    from db.session import dispose_engine, session_scope

    url = f"sqlite:///{tmp_path / 'sweep.db'}"
    environ = {k: v for k, v in os.environ.items() if not k.startswith("TUNER_")}
    environ.update(PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    sweep = subprocess.Popen(
        [sys.executable, "-m", "tuner.cli.app", "sweep", "--shape", "B=1,H=2,N=64,D=16",
         "--trials", "500", "--db", url], env=environ, cwd=ROOT, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and sweep.poll() is None:
            time.sleep(1)
            if (tmp_path / "sweep.db").exists():
                with session_scope(url, write=False) as s:
                    if any(crud.trial_counts(s).values()):
                        break  # a trial is stored: the sweep is well under way
        assert sweep.poll() is None, sweep.communicate()
        sweep.send_signal(signal.SIGTERM)
        out, err = sweep.communicate(timeout=120)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 143, err
    assert "interrupted: everything measured so far is stored; run the same command again " \
           "to resume" in " ".join(err.split())
    dispose_engine(url)
    with session_scope(url, write=False) as s:
        (row,) = crud.list_sweeps(s)
        assert getattr(row.status, "value", row.status) == "interrupted"


def _commands() -> list[tuple[str, Any]]:
    import typer.main

    from tuner.cli.app import app

    def walk(command: Any, path: str) -> list[tuple[str, Any]]:
        if hasattr(command, "commands"):
            return [found for name, sub in command.commands.items()
                    for found in walk(sub, f"{path} {name}".strip())]
        return [(path, command)]

    return walk(typer.main.get_command(app), "")


def test_every_command_takes_json() -> None:
    # Item 10: TUNING.md says every command takes --json; `tuner serve` did not.
    without = [path for path, command in _commands()
               if not any("--json" in p.opts for p in command.params)]
    assert not without


def test_no_help_text_loses_a_bracketed_word_to_markup() -> None:
    # Item 10: `tuner replay --help` printed "search only the  of this sweep spec": rich read
    # "[space]" as markup. A literal bracket is written "\\[".
    import re

    lost = [f"{path} {p.name}: {p.help}" for path, command in _commands() for p in command.params
            if re.search(r"(?<!\\)\[[^\]]*\]", getattr(p, "help", None) or "")]
    assert not lost
    code, out, _ = cli("replay", "--help")
    assert code == 0 and "search only the [space] of this sweep spec" in " ".join(out.split())


@pytest.fixture
def no_server(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    import uvicorn

    started: list[dict[str, Any]] = []
    monkeypatch.setattr(uvicorn, "run", lambda *a, **kw: started.append(kw))
    monkeypatch.delenv("TUNER_TOKEN", raising=False)
    monkeypatch.delenv("TUNER_DATABASE_URL", raising=False)
    return started


def test_serve_says_where_it_listens(no_server: list[dict[str, Any]], tmp_path: Path) -> None:
    # Item 10: `tuner serve` never said where it listens (uvicorn's line is at INFO).
    db = f"sqlite:///{tmp_path / 'served.db'}"
    code, out, err = cli("serve", "--host", "0.0.0.0", "--port", "8123", "--db", db)
    assert code == 0, err
    said = " ".join(out.split())
    assert f"serving {db} at http://0.0.0.0:8123 (every interface), 1 worker(s)" in said
    assert "reads only (TUNER_TOKEN is not set)" in said
    assert no_server[0]["port"] == 8123  # and then it serves there

    code, out, err = cli("serve", "--host", "::1", "--port", "8124", "--db", db, "--json")
    assert code == 0, err
    assert json.loads(out) == {"url": "http://[::1]:8124", "database": db, "workers": 1,
                               "writes": False}


def a_table() -> Table:
    table = Table(title="[bold]best[/] configs", caption="TFLOP/s: of the best")
    table.add_column("problem")
    table.add_column("TFLOP/s", justify="right")
    table.add_column("config")
    table.add_row("B1 H8 N1024 D64", "512.3", "block_m=128  block_n=[green]64[/]")
    table.add_row("B16 H32/8 N4096 D128", "", "block_m=64\nblock_n=32")
    return table


def test_a_piped_table_is_plain_lines_one_row_each() -> None:
    # Item 10: piped, `tuner best` printed rich's boxes, every row padded to ~270 columns.
    # Numbers right-aligned, a cell on one line with single spaces, an empty one "-".
    assert plain_table(a_table()) == (
        "best configs\n"
        "problem               TFLOP/s  config\n"
        "B1 H8 N1024 D64         512.3  block_m=128 block_n=64\n"
        "B16 H32/8 N4096 D128        -  block_m=64 block_n=32\n"
        "TFLOP/s: of the best\n")


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_still_gets_the_boxed_table() -> None:
    screen = Terminal()
    with contextlib.redirect_stdout(screen):  # the console writes to sys.stdout, as it is
        print_table(a_table())
    assert "┃ problem" in screen.getvalue() and "│ B1 H8 N1024 D64" in screen.getvalue()


def test_the_commands_print_plain_tables_when_piped(tmp_path: Path) -> None:
    code, out, err = cli("list", "templates", "--db", f"sqlite:///{tmp_path / 'x.db'}")
    assert code == 0, err
    header, rows = piped_table(out, "name")
    assert header[:3] == ["name", "version", "registered"]
    assert len(rows) >= 10 and {"flash_fwd", "torch_sdpa"} <= {row[0] for row in rows}
    assert out.splitlines()[0].startswith("templates (")  # the title, then the header
