"""Does hf-lisa install beside a peer without changing what the peer pins? (issue 35, docs/integrations.md)

    python tests/compat/check_peer_install.py PYTHON PEER==VERSION [PEER==VERSION ...]

For each peer, ``PYTHON -m pip install --dry-run --report`` resolves the peer together with this checkout, in the
virtualenv of PYTHON (install the CPU torch there first: `make check-peer-install` does). The check passes when the
resolver succeeds, hf-lisa is in the report, and every package the peer's own metadata pins with ``==`` resolves to
that version. Exit status 1 otherwise, with the resolver's output or the package that moved.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def check(python: str, peer: str) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        report_path = Path(tmp) / "report.json"
        run = subprocess.run([python, "-m", "pip", "install", "--quiet", "--dry-run", "--report", str(report_path),
                              peer, str(ROOT)], capture_output=True, text=True)
        if run.returncode:
            return [f"{peer}: the resolver failed:\n{run.stderr[-3000:]}"]
        report = json.loads(report_path.read_text())
    resolved = {item["metadata"]["name"].lower().replace("_", "-"): item for item in report["install"]}
    peer_name = _name(peer)
    problems = [] if "hf-lisa" in resolved else [f"{peer}: hf-lisa is not in the resolver's report"]
    if peer_name not in resolved:
        return problems + [f"{peer}: {peer_name} is not in the resolver's report"]
    for requirement in resolved[peer_name]["metadata"].get("requires_dist", []):
        if "extra ==" in requirement:
            continue
        pinned = re.match(r"^([A-Za-z0-9_.\-]+)\s*(?:\[[^\]]*\])?\s*==\s*([^,;\s]+)\s*(?:;.*)?$", requirement)
        if not pinned:
            continue
        name, version = pinned.group(1).lower().replace("_", "-"), pinned.group(2)
        got = resolved.get(name, {}).get("metadata", {}).get("version")
        if got is not None and got != version:  # None: already installed and kept (the torch installed first)
            problems.append(f"{peer}: pins {name}=={version}, the resolver chose {got}")
    return problems


def main(argv: list[str]) -> int:
    python, peers = argv[0], argv[1:]
    failed = False
    for peer in peers:
        problems = check(python, peer)
        print(f"{peer} beside hf-lisa: " + ("resolves, the peer's pins unchanged" if not problems else "FAILS"))
        for problem in problems:
            print("  " + problem)
        failed |= bool(problems)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
