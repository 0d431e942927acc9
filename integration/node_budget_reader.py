"""One "rank" of the node-budget test: reads its balanced share of the shards through 8
DataLoader workers and writes the sample keys it got.

    python integration/node_budget_reader.py URLS_JSON RANK WORLD OUT
"""

from __future__ import annotations

import json
import sys

from torch.utils.data import DataLoader

import cloudshards as wds


def main() -> None:
    urls, rank, world, out = (
        json.loads(sys.argv[1]),
        int(sys.argv[2]),
        int(sys.argv[3]),
        sys.argv[4],
    )
    dataset = wds.WebDataset(
        urls,
        rank=rank,
        world_size=world,
        sample_counts=[40] * len(urls),
        part_bytes=64 << 10,  # many small ranged GETs: the rate limit bites
        concurrency=4,
        retries=20,
    ).to_tuple("__key__")
    loader = DataLoader(dataset, batch_size=None, num_workers=8)
    keys = [key for (key,) in loader]
    with open(out, "w") as f:
        json.dump(keys, f)


if __name__ == "__main__":
    main()
