"""obstore's GCS settings as gcsfs reads the options: the bearer token obstore sends is the one
gcsfs itself would send (gcsfs is the oracle), refreshed as gcsfs refreshes it; the endpoint
is gcsfs's; what obstore cannot honour falls back to gcsfs."""

from __future__ import annotations

import datetime
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

import cloudshards as wds
from cloudshards.errors import ShardOpenError
from cloudshards.source.gcsconfig import DEFAULT_BASE_URL, gcs_settings
from cloudshards.source.options import OpenOptions
from cloudshards.source.s3config import Unsupported
from cloudshards.urls import resolve

URL = "gs://bucket/train-000.tar"


@pytest.fixture(autouse=True)
def _no_ambient_google(monkeypatch: pytest.MonkeyPatch) -> None:
    ambient = ("STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_UNIVERSE_DOMAIN",
               "GOOGLE_API_USE_CLIENT_CERTIFICATE", "GOOGLE_APPLICATION_CREDENTIALS")  # fmt: skip
    for name in ambient:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NO_GCE_CHECK", "true")


def settings_for(**gcs: Any) -> dict[str, Any]:
    return gcs_settings(URL, OpenOptions(storage_options={"gs": gcs}))


def gcsfs_bearer(**gcs: Any) -> str:
    """The token in gcsfs's own Authorization header for these options."""
    fs, _ = resolve(URL, {"gs": gcs})
    fs.credentials.maybe_refresh()
    headers: dict[str, str] = {}
    fs.credentials.credentials.apply(headers)
    return headers["authorization"].removeprefix("Bearer ")


def test_anonymous_requests_are_unsigned_and_go_to_the_given_endpoint() -> None:
    settings = settings_for(token="anon", endpoint_url="http://127.0.0.1:4443")
    assert settings == {"base_url": "http://127.0.0.1:4443", "skip_signature": True}


def test_the_emulator_from_the_environment_is_gcsfs_endpoint(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert settings_for(token="anon")["base_url"] == DEFAULT_BASE_URL
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "127.0.0.1:9023")
    assert settings_for(token="anon")["base_url"] == "http://127.0.0.1:9023"
    # No token at all: gcsfs's chain finds nothing for an emulator and goes anonymous.
    assert settings_for().get("skip_signature") is True


def test_a_credentials_object_gives_gcsfs_token_and_its_expiry() -> None:
    from google.oauth2.credentials import Credentials

    expiry = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)
    expiry += datetime.timedelta(hours=1)
    given = Credentials(token="ya29.given-token", expiry=expiry)
    token = settings_for(token=given)["credentials"]()
    assert token["token"] == gcsfs_bearer(token=given) == "ya29.given-token"
    assert token["expires_at"] == expiry.replace(tzinfo=datetime.timezone.utc)
    assert "ya29" not in repr(settings_for(token=given))


class _TokenServer(BaseHTTPRequestHandler):
    """An OAuth2 token endpoint: each request gets a new access token, or (``revoked``) the
    answer Google gives for a revoked or expired grant."""

    issued = 0
    revoked = False

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        type(self).issued += 1
        answer = {"access_token": f"tok-{self.issued}", "expires_in": 3600}
        if self.revoked:
            answer = {"error": "invalid_grant", "error_description": "Token has been revoked."}
        body = json.dumps(answer).encode()
        self.send_response(400 if self.revoked else 200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def token_uri() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _TokenServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/token"
    server.shutdown()
    server.server_close()
    thread.join()


def service_account(token_uri: str) -> dict[str, str]:
    """A service-account key (a fresh RSA key) whose tokens come from ``token_uri``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    return {
        "type": "service_account", "project_id": "p", "private_key_id": "k1",
        "private_key": pem, "client_email": "loader@p.iam.gserviceaccount.com",
        "client_id": "1", "token_uri": token_uri,
    }  # fmt: skip


def test_a_service_account_token_is_refreshed_by_gcsfs_when_it_expires(token_uri: str) -> None:
    account = service_account(token_uri)
    pem = account["private_key"]
    settings = settings_for(token=account)
    provider = settings["credentials"]
    first = provider()
    assert first["token"].startswith("tok-")
    assert first["expires_at"] > datetime.datetime.now(datetime.timezone.utc)
    assert provider()["token"] == first["token"]  # still valid: no new request
    fs, _ = resolve(URL, {"gs": {"token": account}})
    fs.credentials.credentials.expiry = datetime.datetime(2000, 1, 1)  # gcsfs's own object
    second = provider()
    assert second["token"] != first["token"]
    assert second["token"] == gcsfs_bearer(token=account)
    assert pem not in repr(settings)


@pytest.mark.parametrize(
    ("option", "why"),
    [
        ({"requester_pays": True}, "requester_pays"),
        ({"session_kwargs": {"trust_env": True}}, "session_kwargs"),
    ],
)
def test_what_obstore_cannot_honour_is_left_to_gcsfs(option: dict[str, Any], why: str) -> None:
    with pytest.raises(Unsupported, match=why):
        settings_for(token="anon", **option)


def test_a_revoked_grant_is_access_denied_at_once(
    token_uri: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The credentials cannot be refreshed (an expired or revoked grant): the shard fails as
    access denied, naming it, without a retry and without a request to the store (nothing
    listens at its endpoint)."""
    monkeypatch.setattr(_TokenServer, "revoked", True)
    monkeypatch.setenv("CLOUDSHARDS_TRANSPORT", "obstore")
    account = service_account(token_uri)
    options = {"gs": {"token": account, "endpoint_url": "http://127.0.0.1:9"}}
    with pytest.raises(ShardOpenError, match="access denied") as info:
        list(wds.WebDataset(URL, shardshuffle=False, storage_options=options))
    assert URL in str(info.value)
    assert "retrying" not in caplog.text.lower()
    assert account["private_key"] not in str(info.value)


def test_a_token_endpoint_that_does_not_answer_is_retried_not_denied(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Nothing listens where the token comes from (a metadata server or OAuth endpoint
    down): a transient failure, retried within the bound, never "access denied"."""
    monkeypatch.setenv("CLOUDSHARDS_TRANSPORT", "obstore")
    monkeypatch.setenv("CLOUDSHARDS_RETRIES", "2")
    caplog.set_level("WARNING", logger="cloudshards.fetch")
    account = service_account("http://127.0.0.1:9/token")
    options = {"gs": {"token": account, "endpoint_url": "http://127.0.0.1:9"}}
    with pytest.raises(ShardOpenError) as info:
        list(wds.WebDataset(URL, shardshuffle=False, storage_options=options))
    assert "access denied" not in str(info.value)
    assert "no access token" in str(info.value)
    assert "gave up after 3 attempts" in str(info.value)
    assert "retry 2/2" in caplog.text
