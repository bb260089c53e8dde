"""`python -m modelopt_ext ...` runs the command-line interface."""

from modelopt_ext.cli import run

run()
