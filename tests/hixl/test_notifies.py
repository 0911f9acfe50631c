"""Notifies between two engines in two processes: both ways once each connected to the other, in order,
within the real limits (1024 bytes a field, 4096 waiting per link), and never without a connection."""

from __future__ import annotations

import hixl

from ._local import SERVER, local_engine
from ._peer import peer

ADDRESS = "127.0.0.1:26301"


def test_notifies_both_ways_in_order() -> None:
    with peer() as remote, local_engine(ADDRESS) as local:
        assert remote("initialize", SERVER, {}) == hixl.SUCCESS
        engine = local.engine
        assert engine.send_notify(SERVER, hixl.NotifyDesc("n", "m")) == hixl.NOT_CONNECTED
        assert engine.connect(SERVER, 2000) == hixl.SUCCESS
        # The server reaches its client only once it connected to it too.
        assert remote("send_notify", ADDRESS, ("back", "early")) == hixl.NOT_CONNECTED
        assert remote("connect", ADDRESS, 2000) == hixl.SUCCESS
        sent = [("cache_ready", "block_0"), ("cache_ready", "block_1"), ("é€😀", "x" * 1024)]
        for name, message in sent:
            assert engine.send_notify(SERVER, hixl.NotifyDesc(name, message)) == hixl.SUCCESS
        assert remote("get_notifies") == (hixl.SUCCESS, sent)
        assert remote("get_notifies") == (hixl.SUCCESS, [])
        assert remote("send_notify", ADDRESS, ("back", "at you"), 1000) == hixl.SUCCESS
        ret, notifies = engine.get_notifies()
        assert ret == hixl.SUCCESS
        assert [(n.name, n.notify_msg) for n in notifies] == [("back", "at you")]


def test_notify_limits() -> None:
    with peer() as remote, local_engine() as local:
        assert remote("initialize", SERVER, {}) == hixl.SUCCESS
        engine = local.engine
        assert engine.connect(SERVER, 2000) == hixl.SUCCESS
        # 1024 bytes a field: four-byte characters count four.
        assert engine.send_notify(SERVER, hixl.NotifyDesc("😀" * 256, "")) == hixl.SUCCESS
        assert engine.send_notify(SERVER, hixl.NotifyDesc("😀" * 256 + "x", "")) == hixl.PARAM_INVALID
        assert engine.send_notify(SERVER, hixl.NotifyDesc("", "m" * 1025)) == hixl.PARAM_INVALID
        # A link keeps at most 4096 notifies for its peer's get_notifies.
        for i in range(4095):
            assert engine.send_notify(SERVER, hixl.NotifyDesc("n", str(i))) == hixl.SUCCESS
        assert engine.send_notify(SERVER, hixl.NotifyDesc("n", "one too many")) == hixl.NOTIFY_FAILED
        ret, notifies = remote("get_notifies")
        assert ret == hixl.SUCCESS and len(notifies) == 4096
        assert [m for _, m in notifies[1:]] == [str(i) for i in range(4095)]
        assert engine.send_notify(SERVER, hixl.NotifyDesc("n", "again")) == hixl.SUCCESS
        assert remote("get_notifies") == (hixl.SUCCESS, [("n", "again")])
