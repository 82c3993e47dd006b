"""A shard larger than the memory a process may commit still loads: tensors are read with
positioned reads, never through a mapping of the whole shard (the released Engram shards are
94.56 GiB each, more than a 24-32 GB machine will commit to a private mapping)."""

import json
import os
import re
import struct
import subprocess
import sys
import textwrap

import pytest

from dsv41.generation.generate import decode_one, prefill

BIG_ROWS, ROW_BYTES = 1 << 20, 1 << 16  # a 64 GiB table, held as a hole in a sparse file


def _sparse_checkpoint(folder) -> str:
    """One shard: a small F32 tensor, then a 64 GiB U8 table whose bytes are a hole (zeros) except
    one marked row."""
    os.makedirs(folder, exist_ok=True)
    doc = {
        "small": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "table": {"dtype": "U8", "shape": [BIG_ROWS, ROW_BYTES], "data_offsets": [16, 16 + BIG_ROWS * ROW_BYTES]},
    }
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    shard = os.path.join(folder, "model-00001-of-00001.safetensors")
    with open(shard, "wb") as f:
        f.write(struct.pack("<Q", len(body)) + body + struct.pack("<4f", 1.0, 2.0, 3.0, 4.0))
        data_start = 8 + len(body)
        f.seek(data_start + 16 + 12345 * ROW_BYTES)
        f.write(bytes([7]) * ROW_BYTES)  # row 12345 holds sevens
        f.truncate(data_start + 16 + BIG_ROWS * ROW_BYTES)
    return shard


def test_a_shard_larger_than_the_address_space_allowed_still_reads(tmp_path):
    shard = _sparse_checkpoint(tmp_path / "ck")
    if os.stat(shard).st_blocks * 512 > 1 << 30:
        pytest.fail("the test folder's file system does not keep sparse files sparse")
    # The child caps its address space at what it has mapped after importing torch plus 4 GiB, far
    # below the 64 GiB shard: a mapping of the shard cannot be made there, positioned reads can.
    script = textwrap.dedent(f"""
        import resource, torch, numpy as np
        from dsv41.checkpoint.checkpoint import Checkpoint
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
        limit = vm + (4 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        try:
            np.memmap({str(shard)!r}, dtype=np.uint8, mode="r")
        except (OSError, ValueError, MemoryError):
            print("mapping refused")
        ck = Checkpoint({str(tmp_path / "ck")!r})
        print(ck.read("small").tolist())
        rows = ck.rows("table", np.array([[12345, 0], [12346, 12345]]))
        print(tuple(rows.shape), rows[0, 0].unique().tolist(), rows[0, 1].unique().tolist(),
              rows[1, 1].unique().tolist())
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "mapping refused"  # the cap is real: the old whole-shard mapping fails here
    assert lines[1] == "[1.0, 2.0, 3.0, 4.0]"
    assert lines[2] == f"(2, 2, {ROW_BYTES}) [7] [0] [7]"


def test_a_shard_truncated_after_its_header_was_read_is_one_sentence(tmp_path):
    from dsv41.checkpoint.checkpoint import Checkpoint, LoadError

    shard = _sparse_checkpoint(tmp_path / "ck")
    ck = Checkpoint(str(tmp_path / "ck"))
    os.truncate(shard, os.path.getsize(shard) // 2)
    with pytest.raises(
        LoadError, match=r"tensor table cannot be read \(the file holds .* when its header was checked\)"
    ):
        ck.rows("table", [BIG_ROWS - 1])


@pytest.mark.parametrize("budget", [None, "2GiB"])
def test_a_shard_truncated_during_generation_keeps_the_text_so_far(
    tiny_checkpoint, tmp_path, monkeypatch, capsys, budget
):
    """The Engram shard cut short between two decode steps: one sentence naming the shard, exit 1,
    and the tokens generated before it printed (mapped reads died of SIGBUS here)."""
    import shutil

    from dsv41.app.cli import main
    from dsv41.checkpoint import stores
    from dsv41.checkpoint.checkpoint import Checkpoint

    folder = str(tmp_path / "ck")
    shutil.copytree(tiny_checkpoint, folder)
    engram_shard = Checkpoint(folder).entries["layers.1.engram.embed.weight"][0]
    real, calls = stores.OnDiskEngramTable.gather, []

    def gather(self, ids):
        calls.append(ids.shape)
        if len(calls) == 2 * 4:  # two Engram layers, four forwards, then the cut
            os.truncate(engram_shard, os.path.getsize(engram_shard) // 2)
        return real(self, ids)

    monkeypatch.setattr(stores.OnDiskEngramTable, "gather", gather)
    argv = ["generate", "--checkpoint", folder, "--prompt", "import os", "--max-new-tokens", "8", "--quiet"]
    code = main(argv + (["--memory", budget] if budget else []))
    out, err = capsys.readouterr()
    assert code == 1
    first = err.strip().splitlines()[0]
    assert first.startswith(f"dsv41 generate: {engram_shard}: tensor layers.") and "cannot be read" in first
    kept = re.search(r"stopped after (\d+) of 8 tokens \(the text so far is above\)", err)
    assert kept and 1 <= int(kept.group(1)) < 8
    assert out.strip()  # the text of the tokens kept


def test_an_expert_shard_truncated_under_the_default_expert_cache_is_one_sentence(tiny_checkpoint, tmp_path):
    """A miss read after the shard was cut short: a LoadError naming the shard (a mapped read was
    SIGBUS), and the model's caches as they were."""
    import shutil

    import dsv41
    from dsv41.checkpoint.checkpoint import LoadError

    folder = str(tmp_path / "ck")
    shutil.copytree(tiny_checkpoint, folder)
    model = dsv41.load(folder, quiet=True, expert_cache=1)  # one expert per layer held: every step misses
    logits = prefill(model, model.encode("import os"))
    shard = model.experts.checkpoint.entries["layers.3.ffn.experts.0.w1.weight"][0]
    os.truncate(shard, os.path.getsize(shard) // 2)
    with pytest.raises(LoadError, match=r"^" + re.escape(shard) + r": tensor layers\..*cannot be read"):
        for _ in range(8):
            logits = decode_one(model, int(logits[0].argmax()))
