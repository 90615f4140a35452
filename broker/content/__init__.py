"""The content store: content-addressed blobs, cached per rank, backed by SQLite on rank 0."""
