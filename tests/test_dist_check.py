"""``check_same_length``: ranks that disagree on the epoch's length are told so, by name,
before DDP hangs (two real gloo processes on 127.0.0.1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

import cloudshards as wds


def _rank_main(rank: int, counts: list[int], store: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=len(counts)
    )
    try:
        wds.check_same_length(counts[rank], what="batches")
        result = "ok"
    except RuntimeError as exc:
        result = str(exc)
    finally:
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("counts", "agree"), [([5, 5], True), ([5, 7], False)])
def test_ranks_that_disagree_are_named(tmp_path: Path, counts: list[int], agree: bool) -> None:
    mp.spawn(
        _rank_main,
        args=(counts, str(tmp_path / "store"), str(tmp_path)),
        nprocs=len(counts),
        join=True,
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(len(counts))]
    if agree:
        assert results == ["ok", "ok"]
    else:
        for result in results:
            assert "rank 0: 5, rank 1: 7" in result
            assert "balance='drop'" in result


def test_without_a_process_group_it_does_nothing() -> None:
    wds.check_same_length(3)
