"""``rocketstore inspect``: one read-only pass over what a store holds, as plain data."""

from __future__ import annotations

from pathlib import Path

from ..config import StoreConfig
from ..errors import ConfigError
from ..importjournal import ImportJournal, describe_source, rows_stored
from ..lifecycle import ABORT_FILE, is_locked
from ..store import MessageStore
from .render import human_time


def _time(ms: int) -> str:
    return human_time(ms) if ms and ms > 0 else "-"


def inspect_store(root: Path, config: StoreConfig) -> dict:
    abort = root / ABORT_FILE
    locked = is_locked(root)
    if locked:
        state = "open by a writer (locked)"
    elif abort.exists():
        pid = abort.read_text(errors="replace").strip() or "?"
        state = f"not shut down cleanly (abort file, pid {pid}): the next writer runs crash recovery"
    else:
        state = "closed cleanly"
    # what the log holds up to damage, and the damage said: inspecting is how an operator sees it
    with MessageStore.open(root, config.replace(cut_damaged_log=True), read_only=True) as store:
        log = store.commit_log
        segments = [{"name": m.path.name, "start": m.file_from_offset,
                     "end": m.file_from_offset + m.wrote_position,
                     "firstStoreTime": _time(log.store_time(m.file_from_offset))}
                    for m in log.mapped_files.files]
        queues = []
        for topic in store.topics():
            for queue_id in store.queue_ids(topic):
                low = store.get_min_offset_in_queue(topic, queue_id)
                high = store.get_max_offset_in_queue(topic, queue_id)
                unit = store.queues.get(topic, queue_id).get_unit(high - 1) if high > low else None
                queues.append({"topic": topic, "queueId": queue_id, "minOffset": low, "maxOffset": high,
                               "earliest": _time(store.get_earliest_message_time(topic, queue_id)),
                               "latest": _time(log.store_time(unit[0], unit[1]) if unit else -1)})
        index = [{"name": f.path.name, "beginTimestamp": _time(f.begin_timestamp),
                  "endTimestamp": _time(f.end_timestamp),
                  "beginPhyOffset": f.begin_phy_offset, "endPhyOffset": f.end_phy_offset,
                  "hashSlotCount": f.hash_slot_count, "indexCount": f.index_count}
                 for f in store.index.files]
        try:
            progress = ImportJournal(root).load()
            unfinished = None if progress is None or progress.complete else {
                "source": describe_source(progress.source), "rowsStored": rows_stored(store, progress)}
        except ConfigError as exc:
            unfinished = {"error": str(exc)}
        cp = store.checkpoint
        return {
            "unfinishedImport": unfinished,
            "root": str(root), "state": state, "locked": locked, "abort": abort.exists(),
            "minOffset": log.min_offset, "maxOffset": log.max_offset,
            "recovery": {"endOffset": store.recovery.end_offset, "stopReason": store.recovery.stop_reason,
                         "bytesAfterEnd": store.recovery.bytes_after_end, "resumesAt": store.recovery.resumes_at},
            "segments": segments, "queues": queues, "index": index,
            "checkpoint": {"physicMsgTimestamp": _time(cp.physic_msg_timestamp),
                           "logicsMsgTimestamp": _time(cp.logics_msg_timestamp),
                           "indexMsgTimestamp": _time(cp.index_msg_timestamp),
                           "confirmPhyOffset": cp.confirm_phy_offset, "trusted": cp.trusted},
        }
