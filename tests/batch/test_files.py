"""The batch file store on a real Redis: what every gateway replica and RQ worker of a
pool sees. Lines across blocks, retention, size limit, ids, files half written."""

import io
import tracemalloc
import uuid

import orjson
import pytest

from lorapool.batch.files import BLOCK_BYTES, FileStore, FileTooLarge
from lorapool.lifecycle.keys import Keys


@pytest.fixture
def keys(conn):
    keys = Keys(f"test-files-{uuid.uuid4().hex[:10]}")
    yield keys
    for key in conn.scan_iter(keys.pattern):
        conn.delete(key)


def test_files_are_shared_and_live_until_their_retention(conn, keys, redis_url):
    import redis

    store = FileStore(conn, keys, retention_s=60)
    info = store.put(io.BytesIO(b'{"a": 1}\r\n{"b": 2}\n'), "in.jsonl", owner="acme")
    assert info["bytes"] == 19 and info["expires_at"] == info["created_at"] + 60
    other = FileStore(redis.Redis.from_url(redis_url), keys)  # another process's client
    assert list(other.lines(info["id"])) == [b'{"a": 1}', b'{"b": 2}']
    assert other.info(info["id"]) == info and other.owner(info["id"]) == "acme"
    assert 55 <= conn.ttl(keys.file(info["id"])) <= 60
    assert 55 <= conn.ttl(keys.file_data(info["id"])) <= 60
    assert store.ids() == [info["id"]]
    assert store.ids(now=info["expires_at"]) == []  # past it, the index forgets it too
    store.delete(info["id"])
    with pytest.raises(KeyError):
        store.info(info["id"])
    assert not list(conn.scan_iter(keys.pattern))


def test_lines_cross_blocks_and_pages(conn, keys):
    lines = [b"x" * n for n in (0, 1, BLOCK_BYTES - 1, BLOCK_BYTES, 3 * BLOCK_BYTES + 7, 5)]
    body = b"\n".join(lines)  # no newline at the end: the last line still comes
    store = FileStore(conn, keys)
    file_id = store.put(io.BytesIO(body), "in.jsonl")["id"]
    assert conn.llen(keys.file_data(file_id)) == -(-len(body) // BLOCK_BYTES)
    assert list(store.lines(file_id)) == lines
    empty = store.put(io.BytesIO(b""), "empty.jsonl")
    assert empty["bytes"] == 0 and list(store.lines(empty["id"])) == []


def test_a_large_upload_is_streamed(conn, keys):
    """24 MB in and out: the store holds a block and a page at a time, not the file."""
    line = b'{"custom_id": "x", "body": "' + b"y" * 1000 + b'"}\n'
    count = 24 * 1024 * 1024 // len(line)

    class Source(io.RawIOBase):  # made as it is read: the test holds no copy either
        sent = 0

        def read(self, n=-1):
            if self.sent >= count:
                return b""
            take = min(max(n // len(line), 1), count - self.sent)
            self.sent += take
            return line * take

    store = FileStore(conn, keys)
    tracemalloc.start()
    file_id = store.put(Source(), "big.jsonl")["id"]
    seen = sum(1 for _ in store.lines(file_id))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert seen == count
    assert peak < count * len(line) / 4, peak


def test_an_upload_over_the_limit_leaves_nothing(conn, keys):
    store = FileStore(conn, keys, max_bytes=100)
    with pytest.raises(FileTooLarge):
        store.put(io.BytesIO(b"x" * 101), "big.jsonl")
    assert not list(conn.scan_iter(keys.pattern))


def test_a_file_being_written_is_invisible_until_finished(conn, keys):
    store = FileStore(conn, keys)
    writer = store.writer("out.jsonl")
    for i in range(3000):  # over a block: some of it is in Redis already
        writer.write({"i": i, "pad": "z" * 40})
    assert conn.exists(keys.file_part(writer.id)) and conn.ttl(keys.file_part(writer.id)) > 0
    with pytest.raises(KeyError):
        store.info(writer.id)
    info = writer.finish()
    assert [orjson.loads(x)["i"] for x in store.lines(info["id"])] == list(range(3000))
    dropped = store.writer("out.jsonl")
    dropped.write({"i": 0})
    dropped.discard()
    assert not conn.exists(keys.file_part(dropped.id))


def test_an_output_line_stays_one_line_for_splitlines(conn, keys):
    """A model's text holding U+0085, U+2028 or U+2029 (valid raw in JSON, a line's end to
    ``str.splitlines``): ``client.files.content(id).text.splitlines()`` reads one record a
    line, each the value written (the deploy test once read a batch output line cut
    there, as JSON that did not parse)."""
    store = FileStore(conn, keys)
    writer = store.writer("out.jsonl")
    records = [{"text": f"a{end}b", "i": i} for i, end in enumerate("\x85\u2028\u2029\n")]
    for record in records:
        writer.write(record)
    info = writer.finish()
    text = b"".join(line + b"\n" for line in store.lines(info["id"])).decode()
    assert [orjson.loads(line) for line in text.splitlines()] == records


@pytest.mark.parametrize("bad", ["", "file-../../etc/passwd", "file-" + "0" * 31, "../x", None])
def test_malformed_ids_are_unknown(conn, keys, bad):
    with pytest.raises(KeyError):
        FileStore(conn, keys).info(bad)
