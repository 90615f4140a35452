"""The key-value store: tree objects, I/O-free lookup/commit engines, and the kvs module."""
