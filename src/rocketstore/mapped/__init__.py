"""Memory-mapped, pre-allocated segment files and the ordered queues they form."""

from .file import MappedFile, segment_name
from .file_queue import MappedFileQueue

__all__ = ["MappedFile", "MappedFileQueue", "segment_name"]
