"""What a job costs the store and each node, from 1 to 64 nodes and up to 10^6 shards, without
a cluster: the real scheduling code on a fake store and a fake clock.

Real code: the shard list (``expand_urls`` of the brace spec), the epoch's shard order, each
consumer's part of the epoch (``assign_samples`` when balanced by counts; webdataset's node
and worker split when count-free), the part plan that a measured link gives
(``adapt.plan`` after ``adapt.record`` of a fake transfer at ``--conn-mbps``, and with
``--demand-mbps`` ``adapt.record_reading`` of a worker that takes that much), and the node
budget's defaults for the node's link and memory (``--nic-gbps``, ``--memory-gib``: the
requests that fill the link at the measured connection rate, a share of the memory for
buffers). The clock is a fluid model: every request in flight on a node shares its NIC
(``--nic-gbps``) at most ``--conn-mbps`` each, after ``--latency-ms``; no thread or socket
per simulated worker. Node 0's consumers are computed exactly; the others are symmetric.

Rows, for each way of getting the sample counts (``counting``: the counting pass, once per job
with each node counting its 1/N of the shards, the default of a plain DataLoader without
index; ``index``: an index or sizes.json beside the shards; ``count-free``: cloudshards'
loaders without counts): bytes each node reads before
its first sample and the time until then, its first-epoch bytes against its share of the
dataset, the GETs in flight per node (with the node budget, and what the per-worker settings
alone would allow), the memory they hold, and GETs per second on the store's prefix.

    python benchmarks/simulate_scale.py
    python benchmarks/simulate_scale.py --shards 10000 1000000 --nodes 1 16 64
    python benchmarks/simulate_scale.py --shards 10000 --nodes 1 16 64 --demand-mbps 20
"""

from __future__ import annotations

import argparse
import itertools
import sys

from _common import format_table, use_checkout

use_checkout()

from cloudshards.balance import assign_samples  # noqa: E402
from cloudshards.shards import epoch_shard_order  # noqa: E402
from cloudshards.source import adapt  # noqa: E402
from cloudshards.source.budget import (  # noqa: E402
    default_buffer_bytes,
    requests_for_link,
)
from cloudshards.source.options import FetchOptions  # noqa: E402
from cloudshards.source.parts import FIRST_PART_BYTES  # noqa: E402
from cloudshards.urls import expand_urls  # noqa: E402

GiB = 1 << 30


def node_share(urls: list[str], counts: list[int], nodes: int, ranks: int, workers: int) -> int:
    """Samples node 0 reads in a balanced epoch: the real assignment of each of its
    consumers (their runs come first in the epoch's sequence)."""
    order = [{"url": urls[i], "shard_index": i} for i in epoch_shard_order(len(urls), 0, 0)]
    by_index = dict(enumerate(counts))
    consumers = nodes * ranks * workers
    total = 0
    for consumer in range(ranks * workers):  # node 0 holds ranks 0..ranks-1
        for part in assign_samples(
            order, by_index, consumer=consumer, num_consumers=consumers, mode="drop"
        ):
            total += part["take"]
    return total


def node_shards_count_free(shards: int, nodes: int, ranks: int) -> int:
    """Shards node 0 reads whole in a count-free epoch: webdataset's split by rank (then by
    worker, which only divides them further)."""
    order = epoch_shard_order(shards, 0, 0)
    world = nodes * ranks
    return sum(len(order[rank::world]) for rank in range(ranks))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shards", type=int, nargs="+", default=[10_000, 1_000_000])
    p.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 16, 64])
    p.add_argument("--ranks", type=int, default=8, help="ranks per node")
    p.add_argument("--workers", type=int, default=8, help="DataLoader workers per rank")
    p.add_argument("--shard-mib", type=float, default=256.0)
    p.add_argument("--samples", type=int, default=2000, help="samples per shard")
    p.add_argument("--latency-ms", type=float, default=30.0)
    p.add_argument("--conn-mbps", type=float, default=100.0, help="MB/s per connection")
    p.add_argument("--nic-gbps", type=float, default=100.0, help="Gbit/s per node")
    p.add_argument("--memory-gib", type=float, default=1024.0, help="memory per node")
    p.add_argument(
        "--demand-mbps",
        type=float,
        help="MB/s each worker's training takes (default: as fast as the link brings)",
    )
    args = p.parse_args()

    fetch = FetchOptions()
    url0 = "s3://bucket/train-0000000.tar"
    adapt.forget()
    conn = args.conn_mbps * 1e6
    latency = args.latency_ms / 1000
    # The fake clock: a small first part (time to first byte), then a 2 MiB part.
    adapt.record(url0, FIRST_PART_BYTES, latency)
    adapt.record(url0, 2 << 20, latency + (2 << 20) / conn)
    shard_bytes = args.shard_mib * (1 << 20)
    if args.demand_mbps:  # a reader measured at this demand: its windows follow it
        adapt.record_reading(url0, int(shard_bytes), shard_bytes / (args.demand_mbps * 1e6))
    plan = adapt.plan(url0, fetch.part_bytes, fetch.concurrency, FIRST_PART_BYTES)
    per_worker = plan.in_flight * (fetch.prefetch + 1)
    in_flight_bytes = plan.in_flight * plan.part_bytes
    nic = args.nic_gbps * 1e9 / 8
    # The node budget's defaults, as a node reporting this NIC and memory sizes them.
    node_requests = requests_for_link(int(nic), adapt.connection_rate())
    node_buffers = default_buffer_bytes(int(args.memory_gib * GiB))
    rows = []
    for shards, nodes in itertools.product(args.shards, args.nodes):
        spec = f"s3://bucket/train-{{0000000..{shards - 1:07d}}}.tar"
        urls = expand_urls(spec)
        counts = [args.samples] * shards
        dataset = shards * shard_bytes
        share = node_share(urls, counts, nodes, args.ranks, args.workers) / args.samples
        unbudgeted = args.ranks * args.workers * per_worker
        flight = min(node_requests, unbudgeted)
        link = min(nic, flight * conn)  # the node's throughput, reading as fast as it can
        rate = link  # while training: no faster than its training takes the samples
        if args.demand_mbps:
            rate = min(rate, args.ranks * args.workers * args.demand_mbps * 1e6)
        gets = nodes * rate / plan.part_bytes
        # Buffers: each worker's shard being read and those ahead hold their parts in flight,
        # within the node's buffer budget.
        windows = args.ranks * args.workers * (fetch.prefetch + 1) * in_flight_bytes
        buffered = min(node_buffers, windows)
        first_s = latency + FIRST_PART_BYTES / min(conn, link / flight)
        first_bytes = flight * FIRST_PART_BYTES  # every request in flight got as far
        free = node_shards_count_free(shards, nodes, args.ranks)
        modes = {
            # Once per job: each node counts its 1/N of the shards (cloudshards.jobcount).
            "counting": (
                dataset / nodes + first_bytes,
                dataset / nodes / link + first_s,
                dataset / nodes + share * shard_bytes,
            ),
            # (The index: one GET of ~50 bytes per shard, before the shards' first parts.)
            "index": (
                50 * shards + first_bytes,
                latency + 50 * shards / conn + first_s,
                share * shard_bytes,
            ),
            "count-free": (first_bytes, latency + first_s, free * shard_bytes),
        }
        fair = dataset / nodes
        for mode, (before, seconds, epoch) in modes.items():
            rows.append(
                [
                    f"{shards:,}",
                    str(nodes),
                    mode,
                    _bytes(before),
                    _seconds(seconds),
                    f"{epoch / fair:.2f}",
                    f"{flight} ({unbudgeted})",
                    _bytes(flight * plan.part_bytes),
                    _bytes(buffered),
                    f"{gets:,.0f}",
                ]
            )
    print(
        f"{args.ranks} ranks x {args.workers} workers per node, shards of "
        f"{args.shard_mib:.0f} MiB x {args.samples} samples; parts of "
        f"{plan.part_bytes >> 20} MiB, {plan.in_flight} per shard, prefetch {fetch.prefetch}; "
        f"{args.conn_mbps:.0f} MB/s per connection, {args.nic_gbps:.0f} Gbit/s and "
        f"{args.memory_gib:.0f} GiB per node ({node_requests} requests, "
        f"{_bytes(node_buffers)} buffers), {args.latency_ms:.0f} ms"
        + (f"; each worker takes {args.demand_mbps:.0f} MB/s" if args.demand_mbps else "")
    )
    header = ["shards", "nodes", "counts", "before 1st", "time to 1st", "epoch / share"]
    header += ["in flight (no budget)", "memory", "buffered", "GET/s on prefix"]
    print(format_table(header, rows))
    return 0


def _bytes(value: float) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if value >= size:
            return f"{value / size:,.1f} {unit}"
    return f"{value:.0f} B"


def _seconds(value: float) -> str:
    if value >= 3600:
        return f"{value / 3600:,.1f} h"
    return f"{value:,.2f} s" if value < 60 else f"{value / 60:,.1f} min"


if __name__ == "__main__":
    sys.exit(main())
