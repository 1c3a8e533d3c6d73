"""State files (state_save_file / state_load_file and their sequence twins): a file is checked against
its own length before its body is read (sparse files of 1 and 16 GiB with a valid header, lying
token counts and blob lengths, truncations, trailing bytes: StateError at once, with almost nothing
allocated), its body is streamed (a load holds about the file, a refused configuration not even
that), a valid file still restores bit for bit, and saving never replaces what is not a regular
file (directory, symbolic link, FIFO, device) nor writes through a planted temporary name. After
every failed load the destination is empty."""
import os
import re
import stat
import struct
import threading
import tracemalloc
import zlib

import numpy as np
import pytest

from llamax import Batch, StateError
from llamax.context import Context

FILE_HEAD = 16  # magic, version, n_tokens
BLOB_HEAD = 64
GiB = 1 << 30
MiB = 1 << 20
TOKENS = [1, 2, 3, 4, 5]


# ---- helpers ---------------------------------------------------------------------------------------
_BUSY: dict = {}


def busy(model) -> Context:
    """A destination holding two sequences (so that 'left empty' means something); decoded once."""
    ctx = Context(model, n_ctx=256, n_seq_max=2)
    if "blob" not in _BUSY:
        ctx.decode(Batch.one(model.tokenize("Hello there my friend"), seq_id=0))
        ctx.decode(Batch.one(model.tokenize("Hi"), seq_id=1))
        _BUSY["blob"] = ctx.state_get_data()
    else:
        ctx.state_set_data(_BUSY["blob"])
    assert ctx.memory.seq_pos_max(0) >= 0 and ctx.memory.seq_pos_max(1) >= 0
    return ctx


def traced(fn):
    """(result or exception, peak bytes allocated by fn: numpy arrays, bytes, lists)."""
    tracemalloc.start()
    try:
        try:
            out = fn()
        except BaseException as e:  # noqa: BLE001 - returned to the test
            out = e
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def refused(model, path, match: str, seq: bool = False) -> int:
    """Load path into a busy destination: StateError matching `match`, the destination (the whole
    context, or sequence 0 with sequence 1 untouched) left empty. Returns the peak bytes allocated."""
    dst = busy(model)
    other = [c for c in dst.memory.cells() if c[0] >= 0 and 1 in c[1]]
    load = (lambda: dst.state_seq_load_file(path, 0)) if seq else (lambda: dst.state_load_file(path))
    err, peak = traced(load)
    assert isinstance(err, StateError), err
    assert re.search(match, str(err)), str(err)
    if seq:
        assert dst.memory.seq_pos_max(0) == -1
        assert [c for c in dst.memory.cells() if c[0] >= 0] == other
    else:
        assert dst.memory.n_used == 0
        assert dst.get_logits().shape == (0, model.n_vocab)
    return peak


def layout(raw: bytes) -> tuple[int, int, int]:
    """(blob offset, meta_len, data_len) of a state file's bytes."""
    (n_tokens,) = struct.unpack_from("<I", raw, 12)
    at = FILE_HEAD + 4 * n_tokens + 4
    meta_len, data_len = struct.unpack_from("<QQ", raw, at + 32)
    return at, meta_len, data_len


def with_lengths(raw: bytes, meta_len: int | None = None, data_len: int | None = None) -> bytearray:
    """raw with the blob's meta_len / data_len replaced and the header's CRC made valid again."""
    at, m, d = layout(raw)
    out = bytearray(raw)
    struct.pack_into("<QQ", out, at + 32, m if meta_len is None else meta_len, d if data_len is None else data_len)
    m_pad = m + (-m % 8)
    head = out[at:at + BLOB_HEAD]
    crc = zlib.crc32(out[at + BLOB_HEAD:at + BLOB_HEAD + m_pad], zlib.crc32(head[60:64], zlib.crc32(head[:56])))
    struct.pack_into("<I", out, at + 56, crc)
    return out


def sparse(path, head: bytes, size: int) -> None:
    """A file of `size` bytes (a hole after `head`: nothing on disk, zeros when read)."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)


@pytest.fixture(scope="module")
def files(model, tmp_path_factory):
    """(whole-context file bytes, sequence-0 file bytes) of a context holding two sequences."""
    ctx = busy(model)
    d = tmp_path_factory.mktemp("state_files")
    ctx.state_save_file(d / "whole", TOKENS)
    ctx.state_seq_save_file(d / "seq", 0, TOKENS)
    return (d / "whole").read_bytes(), (d / "seq").read_bytes()


# ---- valid files --------------------------------------------------------------------------------------
def test_valid_files_round_trip_bit_exactly_holding_about_the_file(model, tmp_path):
    src = busy(model)
    path = tmp_path / "whole.state"
    src.state_save_file(path, TOKENS)
    size = path.stat().st_size
    dst = Context(model, n_ctx=256, n_seq_max=2)
    tokens, peak = traced(lambda: dst.state_load_file(path))
    assert tokens == TOKENS
    assert peak < size + 2 * MiB, (peak, size)  # the data chunks and one copy of the logits at most
    assert np.array_equal(dst.get_logits(), src.get_logits())
    assert dst.state_get_data() == src.state_get_data()
    for ctx in (src, dst):
        ctx.decode(Batch([29, 11], seq_ids=[0, 1]))
    assert np.array_equal(dst.get_logits(), src.get_logits())  # bit for bit
    # saving again replaces the regular file atomically (a new inode, nothing left beside it)
    ino = path.stat().st_ino
    src.state_save_file(path, [9])
    assert path.stat().st_ino != ino and dst.state_load_file(path) == [9]
    assert [p.name for p in tmp_path.iterdir()] == ["whole.state"]


def test_sequence_file_round_trips_bit_exactly(model, tmp_path):
    src = Context(model, n_ctx=256, n_seq_max=2)
    src.decode(Batch(model.tokenize("Once upon a time")))
    path = tmp_path / "seq.state"
    src.state_seq_save_file(path, 0, [7, 8])
    dst = Context(model, n_ctx=256, n_seq_max=2)
    dst.decode(Batch.one(model.tokenize("Hi"), seq_id=0))  # replaced
    assert dst.state_seq_load_file(path, 0) == [7, 8]
    assert dst.memory.cells() == src.memory.cells()
    for ctx in (src, dst):
        ctx.decode(Batch([11]))
    assert np.array_equal(dst.get_logits(), src.get_logits())  # the same cells: bit for bit
    other = busy(model)  # into another sequence, next to one that stays
    assert other.state_seq_load_file(path, 1) == [7, 8]
    assert other.memory.seq_pos_max(1) == src.memory.seq_pos_max(0) - 1 and other.memory.seq_pos_max(0) >= 0


def test_a_refused_configuration_reads_only_the_metadata(model, tmp_path):
    src = Context(model, n_ctx=256)
    src.decode(Batch(model.tokenize("The quick brown fox jumps over the lazy dog. " * 8)))
    path = tmp_path / "s.state"
    src.state_save_file(path, TOKENS)
    size = path.stat().st_size
    assert size > MiB
    dst = Context(model, n_ctx=256, flash_attn=False)  # V transposed: another configuration
    err, peak = traced(lambda: dst.state_load_file(path))
    assert isinstance(err, StateError) and "v_trans" in str(err)
    assert peak < size // 4, (peak, size)
    assert dst.memory.n_used == 0


# ---- lengths that are not the file's ---------------------------------------------------------------
@pytest.mark.parametrize("size", [GiB, 16 * GiB], ids=["1GiB", "16GiB"])
@pytest.mark.parametrize("seq", [False, True], ids=["whole", "seq"])
def test_sparse_file_with_a_valid_header_is_refused_without_reading_it(model, files, tmp_path, size, seq):
    raw = files[seq]
    at, _, _ = layout(raw)
    path = tmp_path / "sparse.state"
    sparse(path, raw[:at + BLOB_HEAD], size)
    peak = refused(model, path, "unexpected bytes after the state", seq=seq)
    assert peak < MiB, peak


@pytest.mark.parametrize("size", [GiB, 16 * GiB], ids=["1GiB", "16GiB"])
def test_sparse_file_whose_lengths_add_up_is_refused_after_what_the_memory_asked(model, files, tmp_path, size):
    """data_len (CRC made valid) claims the whole hole: the memory reads its chunks, then the rest is
    refused without being read."""
    raw = files[0]
    at, m, d = layout(raw)
    path = tmp_path / "sparse.state"
    body = with_lengths(raw, data_len=size - at - BLOB_HEAD - (m + (-m % 8)))
    sparse(path, bytes(body), size)
    peak = refused(model, path, "unexpected bytes at the end of the state data")
    assert peak < 2 * len(raw) + MiB, (peak, len(raw))


def test_token_count_beyond_a_sparse_file_is_refused_before_the_tokens_are_read(model, files, tmp_path):
    raw = bytearray(files[0])
    struct.pack_into("<I", raw, 12, 2**32 - 1)  # 16 GiB of tokens in a 17 GiB file
    path = tmp_path / "tokens.state"
    sparse(path, bytes(raw), 17 * GiB)
    assert refused(model, path, "not a llamax state") < MiB
    struct.pack_into("<I", raw, 12, 2**30)  # more tokens than the file holds
    path.write_bytes(bytes(raw))
    refused(model, path, "truncated state file")


@pytest.mark.parametrize("seq", [False, True], ids=["whole", "seq"])
def test_lying_lengths_truncations_and_trailing_bytes(model, files, tmp_path, seq):
    raw = files[seq]
    at, m, d = layout(raw)
    path = tmp_path / "bad.state"
    cases = [
        (with_lengths(raw, meta_len=m + 8), "truncated"),
        (with_lengths(raw, meta_len=max(m - 8, 0)), "unexpected bytes after the state"),
        (with_lengths(raw, data_len=d + 8), "truncated"),
        (with_lengths(raw, data_len=d - 8), "unexpected bytes after the state"),
        (with_lengths(raw, data_len=d - 4), "not a multiple of 8"),
        (with_lengths(raw, meta_len=2**63, data_len=2**63), "truncated"),
        (raw + b"\0" * 8, "unexpected bytes after the state"),
        (raw + b"x", "unexpected bytes after the state"),
    ]
    for cut in (0, 7, FILE_HEAD - 1, FILE_HEAD + 3, at + 10, at + BLOB_HEAD + 5, at + BLOB_HEAD + m + 8,
                len(raw) - 8, len(raw) - 1):
        cases.append((raw[:cut], "truncated"))
    for body, match in cases:
        path.write_bytes(bytes(body))
        assert refused(model, path, match, seq=seq) < len(raw) + MiB


@pytest.mark.parametrize("seq", [False, True], ids=["whole", "seq"])
def test_a_negative_token_with_a_valid_checksum_is_refused(model, files, tmp_path, seq):
    # found by tests/fuzz/state.py: the tokens' CRC made valid again after an id became negative;
    # state_load_file returned the negative id (save_file never writes one)
    raw = bytearray(files[1] if seq else files[0])
    struct.pack_into("<i", raw, FILE_HEAD + 4 * 2, -962880145)
    end = FILE_HEAD + 4 * len(TOKENS)
    struct.pack_into("<I", raw, end, zlib.crc32(bytes(raw[:end])))
    (tmp_path / "neg").write_bytes(raw)
    refused(model, tmp_path / "neg", r"token 2 is -962880145, outside \[0, 2\*\*31\)", seq=seq)


@pytest.mark.parametrize("seq", [False, True], ids=["whole", "seq"])
def test_flipped_bits_in_the_body_are_refused(model, files, tmp_path, seq):
    raw = files[seq]
    at, m, d = layout(raw)
    path = tmp_path / "flip.state"
    for off in (at + BLOB_HEAD + 3, at + BLOB_HEAD + m - 1, len(raw) - d, len(raw) - d // 2, len(raw) - 9):
        bad = bytearray(raw)
        bad[off] ^= 0x04
        path.write_bytes(bytes(bad))
        refused(model, path, "checksum", seq=seq)


# ---- paths that are not regular files ---------------------------------------------------------------
def device(tmp_path):
    """A character device to point at: a null device made in tmp_path (as root), else /dev/null."""
    if os.geteuid() != 0:
        return "/dev/null"  # saving over it fails with PermissionError on a code that would try
    node = tmp_path / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except OSError as e:
        pytest.skip(f"cannot make a device node: {e}")
    return str(node)


def test_load_from_what_is_not_a_regular_file(model, tmp_path):
    refused(model, tmp_path, "is a directory")
    refused(model, device(tmp_path), "is a character device", seq=True)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    done, rescued = threading.Event(), []

    def rescue() -> None:  # a load that waits for a writer would hang: open the other end
        if not done.wait(20):
            rescued.append(True)
            with open(fifo, "wb"):
                pass

    t = threading.Thread(target=rescue, daemon=True)
    t.start()
    try:
        refused(model, fifo, "is a FIFO")
    finally:
        done.set()
        t.join()
    assert not rescued, "the load waited for a writer on the FIFO"
    # a file that cannot be opened changes nothing, as in llama.cpp (a mistyped path keeps the cache)
    dst = busy(model)
    before, logits = dst.memory.cells(), dst.get_logits().copy()
    with pytest.raises(FileNotFoundError):
        dst.state_load_file(tmp_path / "missing.state")
    with pytest.raises(FileNotFoundError):
        dst.state_seq_load_file(tmp_path / "missing.state", 0)
    assert dst.memory.cells() == before
    np.testing.assert_array_equal(dst.get_logits(), logits)


def test_save_refuses_what_is_not_a_regular_file_and_changes_nothing(model, tmp_path):
    ctx = busy(model)
    target = tmp_path / "target"
    target.write_bytes(b"keep me")
    link = tmp_path / "link"
    link.symlink_to(target)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    folder = tmp_path / "folder"
    folder.mkdir()
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    dev = device(tmp_path)
    cases = [(link, "symbolic link"), (dangling, "symbolic link"), (folder, "directory"), (fifo, "FIFO"),
             (dev, "character device")]
    before = sorted(os.listdir(tmp_path))
    for path, what in cases:
        for save in (lambda: ctx.state_save_file(path, TOKENS), lambda: ctx.state_seq_save_file(path, 1, TOKENS)):
            with pytest.raises(StateError, match=what) as e:
                save()
            assert str(path) in str(e.value)
    assert sorted(os.listdir(tmp_path)) == before  # no temporary file left either
    assert link.is_symlink() and os.readlink(link) == str(target) and target.read_bytes() == b"keep me"
    assert dangling.is_symlink() and not (tmp_path / "nowhere").exists()
    assert folder.is_dir() and not any(folder.iterdir())
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert stat.S_ISCHR(os.lstat(dev).st_mode)


def test_save_never_writes_through_a_planted_temporary_name(model, tmp_path):
    ctx = busy(model)
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    path = tmp_path / "s.state"
    (tmp_path / "s.state.tmp").symlink_to(victim)
    ctx.state_save_file(path, TOKENS)
    assert victim.read_bytes() == b"keep me"
    assert not path.is_symlink() and busy(model).state_load_file(path) == TOKENS
