"""Pipeline stages: webdataset-compatible filters built on plain Python iterators."""
