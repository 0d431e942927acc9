"""Install the system packages the tests need (nginx, FFmpeg), when they are missing.

Run ``python integration/system_deps.py`` before ``pytest integration``; tox does it for you.
Idempotent: when everything is present it only checks and exits 0 in milliseconds.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

# Debian/Ubuntu install nginx to /usr/sbin, which is not on PATH for every user.
_SBIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin")

# executable name -> apt package that provides it
REQUIRED: dict[str, str] = {
    "nginx": "nginx",
    # FFmpeg's shared libraries, which torchcodec loads (the ffmpeg command comes with them)
    "ffmpeg": "ffmpeg",
}


def find_executable(name: str) -> str | None:
    """Return the path of ``name`` on PATH or in the sbin directories, or None."""
    found = shutil.which(name)
    if found is not None:
        return found
    for directory in _SBIN_DIRS:
        candidate = Path(directory) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def missing_packages() -> list[str]:
    """Return the apt packages whose executables cannot be found."""
    return [package for name, package in REQUIRED.items() if find_executable(name) is None]


def _privilege_prefix() -> list[str] | None:
    """Return [] as root, ["sudo", "-n"] with passwordless sudo, else None."""
    if os.geteuid() == 0:
        return []
    sudo = shutil.which("sudo")
    if sudo is None:
        return None
    probe = subprocess.run([sudo, "-n", "true"], capture_output=True, check=False)
    return [sudo, "-n"] if probe.returncode == 0 else None


def install(packages: Sequence[str]) -> int:
    """Install ``packages`` with apt-get; return a process exit status."""
    apt_get = shutil.which("apt-get")
    prefix = _privilege_prefix()
    if apt_get is None or prefix is None:
        why = "apt-get is not available" if apt_get is None else "not root and no passwordless sudo"
        print(
            f"integration tests need: {' '.join(packages)} ({why}).\n"
            f"Install them yourself, e.g.:  sudo apt-get install -y {' '.join(packages)}\n"
            "then rerun the integration tests.",
            file=sys.stderr,
        )
        return 1
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    commands = [
        [*prefix, apt_get, "update", "-qq"],
        [*prefix, apt_get, "install", "-y", "-qq", "--no-install-recommends", *packages],
    ]
    for command in commands:
        print("+", " ".join(command), flush=True)
        result = subprocess.run(command, env=env, check=False)
        if result.returncode != 0:
            print(f"failed ({result.returncode}): {' '.join(command)}", file=sys.stderr)
            return result.returncode
    return 0


def main() -> int:
    """Install what is missing and report what is present."""
    missing = missing_packages()
    if missing:
        status = install(missing)
        if status != 0:
            return status
        still_missing = missing_packages()
        if still_missing:
            print(f"still missing after install: {' '.join(still_missing)}", file=sys.stderr)
            return 1
    for name in REQUIRED:
        print(f"{name}: {find_executable(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
