"""modelopt_ext/__main__.py: `python -m modelopt_ext` is the command-line interface (`cli.run`): its help lists
every subcommand, argparse's usage errors exit 2, and a command's own status becomes the process's."""

import subprocess
import sys

from modelopt_ext.cli import COMMANDS


def _run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "modelopt_ext", *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def test_help_lists_every_subcommand():
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: modelopt-ext ")
    assert sorted(COMMANDS) == ["forward", "lock-remote-code", "make-tiny", "plan", "ptq", "verify"]
    for command in COMMANDS:
        assert command in proc.stdout, command


def test_a_bad_subcommand_exits_2():
    bad = _run("quantize")
    assert bad.returncode == 2 and "invalid choice: 'quantize'" in bad.stderr and bad.stdout == ""


def test_a_command_error_is_one_line_and_exit_2(tmp_path):
    proc = _run("verify", str(tmp_path / "missing"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("modelopt-ext verify: error: ")
    assert "Traceback" not in proc.stderr
