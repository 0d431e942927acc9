"""obstore's S3 credentials as botocore's chain would give them (the chain is the oracle), and
without importing botocore where the environment holds the keys (every DataLoader worker that
opens a shard would pay its import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cloudshards.source.s3config import Credentials

KEYS = {"AWS_ACCESS_KEY_ID": "AKIDENV", "AWS_SECRET_ACCESS_KEY": "envsecret"}


def botocore_keys(profile: str | None = None) -> tuple[str, str, str | None]:
    import botocore.session  # type: ignore[import-untyped]

    frozen = botocore.session.Session(profile=profile).get_credentials().get_frozen_credentials()
    return frozen.access_key, frozen.secret_key, frozen.token


def given_keys(credentials: Credentials) -> tuple[str, str, str | None]:
    found = credentials()
    return found["access_key_id"], found["secret_access_key"], found["token"]


@pytest.fixture
def aws_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A profile 'train' in a credentials file of the test's own (never the user's)."""
    credentials = tmp_path / "credentials"
    credentials.write_text("[train]\naws_access_key_id = AKIDPROFILE\naws_secret_access_key = p\n")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("aws_files")
@pytest.mark.parametrize("token", [None, "envtoken"])
def test_environment_keys_are_botocores(monkeypatch: pytest.MonkeyPatch, token: str | None) -> None:
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    if token is not None:
        monkeypatch.setenv("AWS_SESSION_TOKEN", token)
    assert given_keys(Credentials({}, None)) == botocore_keys() == ("AKIDENV", "envsecret", token)


@pytest.mark.usefixtures("aws_files")
def test_an_explicit_profile_wins_over_environment_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    assert given_keys(Credentials({}, "train")) == botocore_keys("train")
    assert given_keys(Credentials({}, "train"))[0] == "AKIDPROFILE"
    # AWS_PROFILE is not an explicit profile for botocore: the environment's keys still win.
    monkeypatch.setenv("AWS_PROFILE", "train")
    assert given_keys(Credentials({}, None)) == botocore_keys() == ("AKIDENV", "envsecret", None)


@pytest.mark.usefixtures("aws_files")
def test_keys_in_the_options_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in KEYS.items():
        monkeypatch.setenv(name, value)
    given = Credentials({"key": "AKIDGIVEN", "secret": "s", "token": "t"}, None)
    assert given_keys(given) == ("AKIDGIVEN", "s", "t")


def test_environment_keys_need_no_botocore(tmp_path: Path) -> None:
    code = (
        "import sys, json\n"
        "from cloudshards.source.s3config import Credentials\n"
        "found = Credentials({}, None)()\n"
        "print(json.dumps([found['access_key_id'], 'botocore' in sys.modules]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(KEYS, AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE="")
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert json.loads(done.stdout) == ["AKIDENV", False]
