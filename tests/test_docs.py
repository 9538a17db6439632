"""The README and docs/ say what a user can run as written: commands that work from a clone without an
activated venv, nothing that overwrites tracked files, no links to files the repository lacks."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from gwtest import free_port, require

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
    assert ".venv/bin/python - <<'EOF'" in text and "$ .venv/bin/python -m bench.gateway.serving" in text
    assert re.search(r"^up: .*\n\t\$\(VENV\)/bin/atomesh up \$\(ARGS\)$", (ROOT / "Makefile").read_text(), re.M)
    assert 'make up ARGS="' in (ROOT / "README.md").read_text()


def test_docs_do_not_call_exported_metrics_unexported() -> None:
    assert "not exported" not in (ROOT / "docs" / "placement.md").read_text()


def documented_commands(doc: Path, heading: str) -> list[list[str]]:
    """The commands of the first code block under `heading`: a line starting with `.venv/bin/` or `curl`
    starts one, the others continue it (after a `\\`, or inside an open quote)."""
    block = doc.read_text().split(heading + "\n", 1)[1].split("```\n", 1)[1].split("```", 1)[0]
    commands: list[str] = []
    for line in block.splitlines():
        if line.startswith((".venv/bin/", "curl ")):
            commands.append(line)
        else:
            commands[-1] += "\n" + line
    return [shlex.split(c.replace("\\\n", " ")) for c in commands]


@pytest.mark.timeout(240)  # ~10 s on a quiet machine; the margin is for a loaded one (three processes load a model)
def test_the_hand_started_pd_commands_serve_the_documented_request(tmp_path: Path) -> None:
    """docs/pd.md's engines, gateway and curl, run as written but for the ports (and this venv's python)."""
    require("mooncake.engine", "P/D engines relay KV over Mooncake")
    ports = {str(p): str(free_port()) for p in (8010, 8020, 6301, 6302, 30000, 29000)}
    commands = [
        [re.sub(r"(?<!\d)(8010|8020|6301|6302|30000|29000)(?!\d)", lambda m: ports[m.group(1)], a) for a in argv]
        for argv in documented_commands(ROOT / "docs" / "pd.md", "### By hand")
    ]
    *servers, curl = commands
    assert [c[0] for c in commands] == [".venv/bin/python", ".venv/bin/python", ".venv/bin/atomesh", "curl"]
    procs = []
    deadline = time.monotonic() + 160

    def wait_answering(*urls: str) -> None:
        while not all(_answers(url) for url in urls):
            for p, f in procs:
                assert p.poll() is None, f"{f.name} exited: {Path(f.name).read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the documented P/D system did not become ready"
            time.sleep(0.25)

    try:
        for i, argv in enumerate(servers):
            exe = [sys.executable] if argv[0].endswith("python") else [sys.executable, "-m", "atomesh"]
            log = open(tmp_path / f"part-{i}.log", "wb")
            procs.append((subprocess.Popen([*exe, *argv[1:]], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT), log))
            if i == 1:
                # The engines load together; the gateway starts once they answer, as from a third terminal (started
                # before, it would probe them again only after its 30-s --worker-startup-check-interval).
                wait_answering(*(f"http://127.0.0.1:{ports[p]}/health" for p in ("8010", "8020")))
        wait_answering(f"http://127.0.0.1:{ports['30000']}/readiness")
        out = subprocess.run(curl, capture_output=True, text=True, timeout=60)
        answer = json.loads(out.stdout)
        assert answer["model"] == "SmolLM2-135M-Instruct", answer
        assert answer["choices"][0]["message"]["content"].strip(), answer
    finally:
        for p, f in procs:
            p.kill()
            p.wait()
            f.close()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False
