"""The README and docs/ say what a user can run as written: commands that work from a clone without an
activated venv, nothing that overwrites tracked files, no links to files the repository lacks."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def tracked() -> set[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout
    return set(out.split())


def test_docs_link_only_files_that_exist() -> None:
    for doc in DOCS:
        text = doc.read_text()
        assert "ARCHITECTURE.md" not in text and "PROTOCOLS.md" not in text, doc.name
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            assert (doc.parent / target).exists(), f"{doc.name} links {target}, which is not in the repository"


def test_documented_commands_do_not_overwrite_tracked_files() -> None:
    files = tracked()
    for doc in DOCS:
        for flag, path in re.findall(r"(--plot|--save-result|--out|--json)\s+(\S+)", doc.read_text()):
            assert path not in files, f"{doc.name}: `{flag} {path}` would overwrite a tracked file"


def test_quickstart_commands_run_without_an_activated_venv() -> None:
    text = (ROOT / "docs" / "quickstart.md").read_text()
    assert "$ python " not in text and "\n  python -" not in text
    assert ".venv/bin/python - <<'EOF'" in text and "$ .venv/bin/atomesh bench serving" in text
    assert re.search(r"^up: .*\n\t\$\(VENV\)/bin/atomesh up \$\(ARGS\)$", (ROOT / "Makefile").read_text(), re.M)
    assert 'make up ARGS="' in (ROOT / "README.md").read_text()


def test_docs_do_not_call_exported_metrics_unexported() -> None:
    assert "not exported" not in (ROOT / "docs" / "placement.md").read_text()
