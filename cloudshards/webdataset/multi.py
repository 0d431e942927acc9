"""webdataset 1.0.2's ``webdataset.multi`` (ZMQ ``MultiLoader``) is not provided."""

raise ImportError(
    "webdataset.multi (MultiLoader over ZMQ) is not supported by cloudshards; use "
    "torch.utils.data.DataLoader(dataset, num_workers=N) or wds.WebLoader (docs/migrating.md)"
)
