"""The key/time hash index: ``IndexFile`` (one file, RocketMQ's bytes) and the service over many files."""

from .file import IndexFile, index_file_size

__all__ = ["IndexFile", "index_file_size"]
