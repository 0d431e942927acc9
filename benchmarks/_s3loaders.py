"""The child side of bench_s3.py: write the data set in every loader's format, or read it.

Runs under the peers' interpreter (benchmarks/.peers/venv, see _s3peers.py), one fresh process
per measurement, never imported by the parent:

    python _s3loaders.py write SPEC_JSON   # write tar / LitData / MDS copies and upload them
    python _s3loaders.py read SPEC_JSON    # two epochs of one loader; prints one JSON line

``read`` times epoch 1 (cold: empty caches, dataset construction included) and epoch 2 (warm,
same dataset and loader), checks each epoch against the manifest the writer left (every key
once, total ``bin`` bytes, a sum over the first 8 bytes of every ``bin``), and records the
user+system CPU of this process and its reaped children (the DataLoader workers, webdataset's
``aws`` pipes) and the GETs and bytes the store saw (``_s3store.StoreCounter``).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Shape, ensure_shards, shard_name, use_checkout
from _s3store import BUCKET, StoreCounter, gcs_upload

Batches = Iterator[tuple[list[str], list[bytes]]]


def _tar_samples(path: Path) -> Iterator[dict[str, Any]]:
    """The samples of one tar shard, exactly as bench's TarWriter wrote them."""
    sample: dict[str, Any] = {}
    with tarfile.open(path) as tar:
        for member in tar:
            if not member.isfile():
                continue
            key, ext = member.name.split(".", 1)
            if sample and sample["key"] != key:
                yield sample
                sample = {}
            f = tar.extractfile(member)
            assert f is not None
            sample["key"] = key
            sample[ext] = f.read()
    if sample:
        yield sample


def _litdata_fn(path: str) -> Iterator[dict[str, Any]]:
    for s in _tar_samples(Path(path)):
        yield {"key": s["key"], "bin": s["bin"], "json": s["json"], "cls": int(s["cls"])}


def write(spec: dict[str, Any]) -> None:
    """Write the three formats under spec['work'] and upload them to the S3 endpoint."""
    import boto3
    import litdata
    from streaming import MDSWriter

    shape = Shape(spec["shards"], spec["samples"], spec["bin_bytes"])
    work = Path(spec["work"])
    tars = work / "tar"
    ensure_shards(tars, shape, log=lambda m: print(m, file=sys.stderr))
    paths = [tars / shard_name(s) for s in range(shape.shards)]
    keys: list[str] = []
    head_sum = nbytes = 0
    mds = work / "mds"
    limit = shape.samples_per_shard * (shape.bin_bytes + 256)
    columns = {"key": "str", "bin": "bytes", "json": "bytes", "cls": "int"}
    with MDSWriter(out=str(mds), columns=columns, compression=None, size_limit=limit) as out:
        for path in paths:
            for s in _tar_samples(path):
                keys.append(s["key"])
                nbytes += len(s["bin"])
                head_sum += int.from_bytes(s["bin"][:8], "little")
                row = {"key": s["key"], "bin": s["bin"], "json": s["json"], "cls": int(s["cls"])}
                out.write(row)
    litdata.optimize(
        fn=_litdata_fn,
        inputs=[str(p) for p in paths],
        output_dir=str(work / "litdata"),
        chunk_size=shape.samples_per_shard,
        num_workers=1,
        mode="overwrite",
        start_method="fork",
    )
    s3 = boto3.client("s3", endpoint_url=spec["endpoint"])
    uploaded = 0
    for fmt in ("tar", "litdata", "mds"):
        for path in sorted((work / fmt).rglob("*")):
            if path.is_file() and path.name != "manifest.json":
                name = f"{fmt}/{path.relative_to(work / fmt)}"
                s3.upload_file(str(path), BUCKET, name)
                uploaded += path.stat().st_size
                if spec.get("gcs_endpoint") and fmt != "mds":  # GCS: cloudshards and LitData
                    gcs_upload(spec["gcs_endpoint"], name, path)
    manifest = {"keys": len(keys), "unique": len(set(keys)), "bytes": nbytes, "head": head_sum}
    (work / "expected.json").write_text(json.dumps(manifest))
    print(json.dumps({"uploaded_bytes": uploaded, **manifest}))


# ------------------------------------------------------------------------ the loaders
def _collate_bytes(batch: list[dict[str, Any]]) -> tuple[list[str], list[bytes]]:
    """LitData hands out memoryviews of its chunk files: copy them to bytes (workers must
    pickle them); the same collate for 0 workers keeps the work identical."""
    return [s["key"] for s in batch], [bytes(s["bin"]) for s in batch]


def loader_cloudshards(spec: dict[str, Any]) -> Callable[[], Batches]:
    use_checkout()
    import cloudshards as wds

    scheme = "gs" if spec.get("store") == "gcs" else "s3"
    urls = f"{scheme}://{BUCKET}/tar/bench-{{000000..{spec['shards'] - 1:06d}}}.tar"
    cache = spec["work_child"] + "/cs-cache" if spec["cache"] else None
    dataset = wds.WebDataset(urls, shardshuffle=False, cache_dir=cache)
    if spec.get("plain"):  # torch's own DataLoader collates in the workers
        from torch.utils.data import DataLoader

        plain = DataLoader(
            dataset.to_tuple("__key__", "bin"),
            batch_size=spec["batch"],
            num_workers=spec["workers"],
        )
        return lambda: iter(plain)
    loader = wds.WebLoader(
        dataset.to_tuple("__key__", "bin").batched(spec["batch"]),
        batch_size=None,
        num_workers=spec["workers"],
    )
    return lambda: iter(loader)


def loader_webdataset(spec: dict[str, Any]) -> Callable[[], Batches]:
    import webdataset as wds

    # webdataset has no s3:// opener; its documentation pipes `aws s3 cp URL -`.
    urls = [
        f"pipe:aws s3 cp --quiet s3://{BUCKET}/tar/{shard_name(s)} -" for s in range(spec["shards"])
    ]
    dataset = wds.WebDataset(urls, shardshuffle=False)
    loader = wds.WebLoader(
        dataset.to_tuple("__key__", "bin").batched(spec["batch"]),
        batch_size=None,
        num_workers=spec["workers"],
    )
    return lambda: iter(loader)


def loader_litdata(spec: dict[str, Any]) -> Callable[[], Batches]:
    import litdata
    import litdata.streaming.downloader as downloader

    if spec.get("store") == "gcs":
        # google-cloud-storage finds the emulator (anonymously) in STORAGE_EMULATOR_HOST, for
        # LitData's metadata. Its chunks go through obstore, as on GCS itself: object_store
        # reads the emulator's endpoint, plain HTTP and unsigned requests from its own
        # environment variables (fake-gcs-server serves the XML API on -public-host).
        os.environ["GOOGLE_BASE_URL"] = os.environ["STORAGE_EMULATOR_HOST"]
        os.environ["GOOGLE_ALLOW_HTTP"] = "true"
        os.environ["GOOGLE_SKIP_SIGNATURE"] = "true"
        dataset = litdata.StreamingDataset(
            f"gs://{BUCKET}/litdata", cache_dir=spec["work_child"] + "/litdata-cache", shuffle=False
        )
    else:
        # obstore refuses http:// endpoints unless told; litdata's own client options drop
        # AWS_ALLOW_HTTP (see PEERS.md).
        options = dict(getattr(downloader, "_OBSTORE_CLIENT_OPTIONS", {}) or {})
        downloader._OBSTORE_CLIENT_OPTIONS = {**options, "allow_http": "true"}
        dataset = litdata.StreamingDataset(
            f"s3://{BUCKET}/litdata",
            cache_dir=spec["work_child"] + "/litdata-cache",
            storage_options={
                "endpoint_url": os.environ["AWS_ENDPOINT_URL"],
                "aws_access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
                "aws_secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"],
                "region_name": "us-east-1",
            },
            shuffle=False,
        )
    loader = litdata.StreamingDataLoader(
        dataset,
        batch_size=spec["batch"],
        num_workers=spec["workers"],
        collate_fn=_collate_bytes,
    )
    return lambda: iter(loader)


def loader_streaming(spec: dict[str, Any]) -> Callable[[], Batches]:
    from streaming import StreamingDataset
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    clean_stale_shared_memory()
    dataset = StreamingDataset(
        remote=f"s3://{BUCKET}/mds",
        local=spec["work_child"] + "/mds-local",
        shuffle=False,
        batch_size=spec["batch"],
    )
    loader = DataLoader(dataset, batch_size=spec["batch"], num_workers=spec["workers"])

    def batches() -> Batches:
        for batch in loader:
            yield batch["key"], batch["bin"]

    return batches


LOADERS: dict[str, Callable[[dict[str, Any]], Callable[[], Batches]]] = {
    "cloudshards": loader_cloudshards,
    "litdata": loader_litdata,
    "streaming": loader_streaming,
    "webdataset": loader_webdataset,
}


def _import_library(name: str, store: str) -> None:
    """Import the loader's modules before any timing (imports are not the loader's speed)."""
    if name == "cloudshards":
        use_checkout()
        import cloudshards

        _ = cloudshards.WebDataset, cloudshards.WebLoader  # the root imports lazily
        from cloudshards.source import transport  # noqa: F401

        if store == "gcs":
            import gcsfs  # noqa: F401
    elif name == "litdata":
        import litdata.streaming.downloader  # noqa: F401

        if store == "gcs":
            from google.cloud import storage  # noqa: F401
    elif name == "streaming":
        import streaming  # noqa: F401
    else:
        import webdataset  # noqa: F401


def _cpu_s() -> tuple[float, float]:
    """User and system CPU seconds of this process and every child it has reaped."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + kids.ru_utime, own.ru_stime + kids.ru_stime


def read(spec: dict[str, Any]) -> None:
    expected = json.loads(Path(spec["expected"]).read_text())
    name = spec["loader"]
    _import_library(name, spec.get("store", "s3"))
    counter = StoreCounter.from_spec(spec["counter"])
    epochs: list[dict[str, Any]] = []
    make: Callable[[], Batches] | None = None
    for epoch in range(1, spec.get("epochs", 2) + 1):
        seen: set[str] = set()
        samples = nbytes = head = dupes = 0
        before = counter.snapshot()
        cpu0, t0 = _cpu_s(), time.perf_counter()
        if make is None:
            make = LOADERS[name](spec)  # construction (index/listing reads) is part of epoch 1
        for keys, bins in make():
            for key, data in zip(keys, bins, strict=True):
                dupes += key in seen
                seen.add(key)
                nbytes += len(data)
                head += int.from_bytes(data[:8], "little")
            samples += len(keys)
        seconds = time.perf_counter() - t0
        user, system = (now - then for now, then in zip(_cpu_s(), cpu0, strict=True))
        gets, store_bytes = counter.since(before)
        problems = []
        if samples != expected["keys"] or len(seen) != expected["unique"] or dupes:
            problems.append(f"{samples} samples ({len(seen)} distinct), want {expected['keys']}")
        if nbytes != expected["bytes"]:
            problems.append(f"{nbytes} bin bytes, want {expected['bytes']}")
        elif head != expected["head"]:
            problems.append("bin contents differ (sum of first 8 bytes)")
        epochs.append(
            {
                "epoch": epoch,
                "seconds": seconds,
                "samples": samples,
                "payload_bytes": nbytes,
                "cpu_s": user + system,
                "sys_s": system,
                "gets": gets,
                "store_bytes": store_bytes,
                "mismatch": "; ".join(problems) or None,
            }
        )
    print("RESULT " + json.dumps({"epochs": epochs}), flush=True)


def main() -> int:
    command, spec = sys.argv[1], json.loads(sys.argv[2])
    if command == "write":
        write(spec)
    elif command == "read":
        read(spec)
    else:
        raise SystemExit(f"unknown command {command!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
