"""The gateway's benchmarks: serving load, placement quality, gateway overhead (`python -m bench.gateway.NAME`)."""

from __future__ import annotations

import argparse
import shutil


def help_formatter(prog: str) -> argparse.HelpFormatter:
    """argparse help laid out like the click commands' (`atomesh ... --help`): up to 110 columns wide."""
    width = min(110, shutil.get_terminal_size((110, 24)).columns)
    return argparse.HelpFormatter(prog, width=width, max_help_position=34)
