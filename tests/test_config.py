"""Environment defaults: CLOUDSHARDS_* first, webdataset's WDS_* variables as a fallback."""

from __future__ import annotations

import pytest

from cloudshards import config
from cloudshards.errors import ConfigError


@pytest.mark.parametrize(
    ("text", "expected"), [("1000", 1000), ("1e18", 10**18), ("2.5e3", 2500), ("0", 0)]
)
def test_cache_size_accepts_webdatasets_float_format(
    monkeypatch: pytest.MonkeyPatch, text: str, expected: int
) -> None:
    monkeypatch.setenv("WDS_CACHE", "/tmp/somewhere")
    monkeypatch.setenv("WDS_CACHE_SIZE", text)
    assert config.cache_defaults() == ("/tmp/somewhere", expected)


@pytest.mark.parametrize("text", ["lots", "1.5", "inf", "nan"])
def test_cache_size_must_be_a_whole_number_of_bytes(
    monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setenv("CLOUDSHARDS_CACHE_SIZE", text)
    with pytest.raises(ConfigError, match="whole number of bytes"):
        config.cache_defaults()


def test_cloudshards_variables_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WDS_CACHE", "/tmp/wds")
    monkeypatch.setenv("CLOUDSHARDS_CACHE_DIR", "/tmp/cs")
    monkeypatch.setenv("WDS_CACHE_SIZE", "5")
    monkeypatch.setenv("CLOUDSHARDS_CACHE_SIZE", "7")
    assert config.cache_defaults() == ("/tmp/cs", 7)
