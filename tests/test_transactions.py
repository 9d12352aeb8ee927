"""Transactional messages in the store: half messages, commit, rollback, reopen, checks."""

from __future__ import annotations

import pyarrow as pa
import pytest

from rocketstore import Message, MessageStore, StoreConfig
from rocketstore.errors import InvalidPropertyError, InvalidTopicError
from rocketstore.message import SysFlag
from rocketstore.transaction import CHECK_MAX_TOPIC, HALF_TOPIC, OP_TOPIC, TransactionLog, UnknownTransactionError

CONFIG = StoreConfig(mapped_file_size_commit_log=64 << 10, mapped_file_size_consume_queue=20 * 100,
                     max_hash_slot_num=97, max_index_num=400, auto_create_topic_enable=False)


def visible(store: MessageStore, topic: str) -> list[bytes]:
    out = []
    for queue_id in store.queue_ids(topic):
        out += [m.body for m in store.get_message(topic, queue_id, 0, 100).messages]
    return out


def test_commit_rollback_and_what_a_reopen_finds_open(tmp_path):
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.create_topic("Orders", 4)
        log = TransactionLog(store, check_after_ms=60_000)
        kept, kept_id = log.prepare(Message("Orders", b"kept", keys=["o-1"], tags="paid", queue_id=3))
        dropped, dropped_id = log.prepare(Message("Orders", b"dropped", queue_id=1))
        _open, open_id = log.prepare(Message("Orders", b"undecided", properties={"who": "me"}))
        store.wait_for_dispatch()
        assert visible(store, "Orders") == [], "half messages are in no queue a consumer reads"
        assert store.get_max_offset_in_queue(HALF_TOPIC, 0) == 3

        for bad in (("not-an-id", kept.uniq_key, "Orders"), (kept_id, "OTHER", "Orders"),
                    (kept_id, kept.uniq_key, "Other")):
            with pytest.raises(UnknownTransactionError):
                log.end(*bad, commit=True)
        result = log.end(kept_id, kept.uniq_key, "Orders", commit=True)
        assert log.end(dropped_id, dropped.uniq_key, "Orders", commit=False) is None
        with pytest.raises(UnknownTransactionError):
            log.end(kept_id, kept.uniq_key, "Orders", commit=False)  # already ended
        store.wait_for_dispatch()
        assert visible(store, "Orders") == [b"kept"]
        msg = store.look_message_by_offset(result.commit_log_offset)
        assert (msg.topic, msg.queue_id, msg.tags, msg.keys, msg.uniq_key) == ("Orders", 3, "paid", ["o-1"],
                                                                              kept.uniq_key)
        assert msg.sys_flag & SysFlag.TRANSACTION_MASK == SysFlag.TRANSACTION_COMMIT_TYPE
        assert msg.prepared_transaction_offset == kept.commit_log_offset
        assert "REAL_TOPIC" not in msg.properties and msg.properties["TRAN_MSG"] == "true"
        assert [m.body for m in store.query_message("Orders", "o-1")] == [b"kept"]
        assert store.get_max_offset_in_queue(OP_TOPIC, 0) == 2
        assert log.open_count() == 1

    with MessageStore.open(tmp_path, CONFIG) as store:
        log = TransactionLog(store, check_after_ms=0)
        assert log.open_count() == 1, "the undecided half is open again after a reopen"
        due = log.due_for_check()
        assert [(m.topic, m.body, m.properties["who"], tid) for m, tid in due] == [("Orders", b"undecided", "me",
                                                                                     open_id)]
        log.end(open_id, due[0][0].uniq_key, "Orders", commit=True)
        store.wait_for_dispatch()
        assert sorted(visible(store, "Orders")) == [b"kept", b"undecided"]
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert TransactionLog(store).open_count() == 0


def test_an_unanswered_transaction_is_parked_after_max_checks(tmp_path):
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.create_topic("Orders", 1)
        log = TransactionLog(store, check_after_ms=1_000, max_checks=2)
        half, tid = log.prepare(Message("Orders", b"lost producer"))
        start = half.store_timestamp
        assert log.due_for_check(now_ms=start + 500) == []
        assert len(log.due_for_check(now_ms=start + 1_000)) == 1
        assert log.due_for_check(now_ms=start + 1_500) == [], "offered again only after the check delay"
        assert len(log.due_for_check(now_ms=start + 2_000)) == 1
        assert log.due_for_check(now_ms=start + 3_000) == [] and log.open_count() == 0
        store.wait_for_dispatch()
        assert visible(store, CHECK_MAX_TOPIC) == [b"lost producer"] and visible(store, "Orders") == []
        with pytest.raises(UnknownTransactionError):
            log.end(tid, half.uniq_key, "Orders", commit=True)


def test_a_delayed_or_flagged_half_is_refused_or_cleaned_and_system_topics_take_no_sends(tmp_path):
    """A half with DELAY was parked in SCHEDULE_TOPIC_XXXX, so its commit landed in the half topic; a half the
    caller flagged PREPARED got no queue offset, so a restart forgot it (and rolling it back closed another
    transaction); and a put straight into a system topic was stored where only the store's services write."""
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.create_topic("Orders", 1)
        log = TransactionLog(store, check_after_ms=60_000)
        for delay in ({"DELAY": "1"}, {"TIMER_DELAY_SEC": "5"}, {"TIMER_DELIVER_MS": "99999999999999"}):
            with pytest.raises(InvalidPropertyError, match="cannot be delayed"):
                log.prepare(Message("Orders", b"pay later", properties=delay))
        assert store.max_phy_offset == 0 and log.open_count() == 0, "refused: nothing written"
        plain, plain_id = log.prepare(Message("Orders", b"B", keys=["o-B"]))
        flagged, flagged_id = log.prepare(Message("Orders", b"A", sys_flag=SysFlag.TRANSACTION_PREPARED_TYPE))
        other, other_id = log.prepare(Message("Orders", b"C", sys_flag=SysFlag.TRANSACTION_ROLLBACK_TYPE))
        assert [plain.queue_offset, flagged.queue_offset, other.queue_offset] == [0, 1, 2]
        log.end(flagged_id, flagged.uniq_key, "Orders", commit=False)
        for topic in (HALF_TOPIC, OP_TOPIC, CHECK_MAX_TOPIC, "SCHEDULE_TOPIC_XXXX", "rmq_sys_wheel_timer",
                      "SELF_TEST_TOPIC", "OFFSET_MOVED_EVENT"):
            end = store.max_phy_offset
            with pytest.raises(InvalidTopicError, match="system topic"):
                store.put_message(Message(topic, b"x"))
            with pytest.raises(InvalidTopicError, match="system topic"):
                store.put_messages([Message("Orders", b"ok")] * 5 + [Message(topic, b"x")])
            with pytest.raises(InvalidTopicError, match=r"row 0: .*system topic"):
                store.put_batch(pa.table({"topic": [topic], "body": [b"x"]}))
            assert store.max_phy_offset == end
    with MessageStore.open(tmp_path, CONFIG) as store:
        log = TransactionLog(store, check_after_ms=60_000)
        assert log.open_count() == 2, "B and C are still open after the restart"
        committed = log.end(other_id, other.uniq_key, "Orders", commit=True)
        log.end(plain_id, plain.uniq_key, "Orders", commit=True)
        store.wait_for_dispatch()
        assert sorted(visible(store, "Orders")) == [b"B", b"C"]
        assert store.look_message_by_offset(committed.commit_log_offset).topic == "Orders"


def test_check_counts_survive_a_restart(tmp_path):
    """The counts lived in memory only: each restart began them at 0 again, so a half whose producer was gone was
    checked 15 more times after every restart and never parked."""
    with MessageStore.open(tmp_path, CONFIG) as store:
        store.create_topic("Orders", 1)
        log = TransactionLog(store, check_after_ms=1_000, max_checks=3)
        half, _tid = log.prepare(Message("Orders", b"lost producer"))
        other, other_id = log.prepare(Message("Orders", b"ended later"))
        start = other.store_timestamp
        assert len(log.due_for_check(now_ms=start + 1_000)) == 2
        assert len(log.due_for_check(now_ms=start + 2_000)) == 2
        log.end(other_id, other.uniq_key, "Orders", commit=False)
    with MessageStore.open(tmp_path, CONFIG) as store:
        log = TransactionLog(store, check_after_ms=1_000, max_checks=3)
        assert log.open_count() == 1 and log.checks.table == {half.commit_log_offset: 2}  # the ended one forgotten
        assert len(log.due_for_check(now_ms=start + 3_000)) == 1  # the third check
    with MessageStore.open(tmp_path, CONFIG) as store:
        log = TransactionLog(store, check_after_ms=1_000, max_checks=3)
        assert log.due_for_check(now_ms=start + 4_000) == [] and log.open_count() == 0  # parked, not checked again
        store.wait_for_dispatch()
        assert visible(store, CHECK_MAX_TOPIC) == [b"lost producer"]
        assert log.checks.table == {}
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert TransactionLog(store).open_count() == 0


def test_torn_or_unwritable_check_counts_cost_checks_not_transactions(tmp_path, monkeypatch, caplog):
    from rocketstore import brokerconfig
    from rocketstore.errors import StoreIOError

    with MessageStore.open(tmp_path, CONFIG) as store:
        store.create_topic("Orders", 1)
        log = TransactionLog(store, check_after_ms=1_000)
        half, tid = log.prepare(Message("Orders", b"x"))
        start = half.store_timestamp

        def refuse(*_args, **_kwargs):
            raise StoreIOError(28, "No space left on device")

        monkeypatch.setattr(brokerconfig, "persist_text", refuse)
        with caplog.at_level("ERROR", logger="rocketstore.transaction"):
            assert len(log.due_for_check(now_ms=start + 1_000)) == 1  # the check goes on
        assert "cannot record the transaction check counts" in caplog.text and log.checks.dirty
        monkeypatch.undo()
        assert len(log.due_for_check(now_ms=start + 2_000)) == 1
        assert not log.checks.dirty  # the next round wrote both
    counts = tmp_path / "config" / "transactionChecks.json"
    assert counts.exists()
    for name in ("transactionChecks.json", "transactionChecks.json.bak"):
        (tmp_path / "config" / name).write_text('{"offsetTable":{"1')  # torn, backup too
    with MessageStore.open(tmp_path, CONFIG) as store:
        log = TransactionLog(store, check_after_ms=1_000)
        assert log.open_count() == 1 and log.checks.table == {}  # counted from 0 again, the half still open
        log.end(tid, half.uniq_key, "Orders", commit=True)
        store.wait_for_dispatch()
        assert visible(store, "Orders") == [b"x"]


def test_an_end_whose_op_message_failed_stores_no_second_copy_when_retried(tmp_path, monkeypatch):
    """The committed copy stored, the op message that closes the half failed: the half went back open with nothing
    remembered, and the retried commit (or the check's answer) stored a second copy, with no crash (the schedule
    review). The retry writes only the op message."""
    from rocketstore.errors import StoreIOError

    with MessageStore.open(tmp_path, CONFIG) as store:
        store.create_topic("Orders", 1)
        log = TransactionLog(store, check_after_ms=60_000)
        half, tid = log.prepare(Message("Orders", b"pay", keys=["o-9"]))
        real = store._put_system

        def op_fails_once(msg):
            if msg.topic == OP_TOPIC and not failed:
                failed.append(msg)
                raise StoreIOError(28, "No space left on device")
            return real(msg)

        failed: list = []
        monkeypatch.setattr(store, "_put_system", op_fails_once)
        with pytest.raises(StoreIOError, match="No space left"):
            log.end(tid, half.uniq_key, "Orders", commit=True)
        assert log.open_count() == 1
        assert log.end(tid, half.uniq_key, "Orders", commit=True) is None  # closed, nothing stored again
        assert log.open_count() == 0
        store.wait_for_dispatch()
        assert visible(store, "Orders") == [b"pay"]
    with MessageStore.open(tmp_path, CONFIG) as store:
        assert TransactionLog(store).open_count() == 0 and visible(store, "Orders") == [b"pay"]
