"""pagedllm's KV events against vLLM's own decoder and encoder (vllm/distributed/kv_events.py), both ways.

vLLM runs in its anchor venv (ANCHORS, see ../shared/anchors/README.md), never as a dependency of pagedllm: this
script writes a pagedllm KVEventBatch, has vLLM's msgspec decoder read it and vLLM's encoder write one back, and
reads that with pagedllm's decoder.

    ANCHORS=$PWD/../anchors-work .venv/bin/python -m benchmarks.kv.events_vs_vllm
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

from pagedllm.kv.events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, encode_batch

VLLM_SIDE = textwrap.dedent("""
    import sys, msgspec
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
    ours, theirs = sys.argv[1:3]
    batch = msgspec.msgpack.Decoder(KVEventBatch).decode(open(ours, "rb").read())
    print("vLLM read:", batch.ts, [(type(e).__name__, len(getattr(e, "block_hashes", []))) for e in batch.events],
          batch.events[0].parent_block_hash, batch.events[0].token_ids[:4], batch.events[0].medium)
    out = KVEventBatch(ts=2.0, events=[
        BlockStored(block_hashes=[b"\\x03" * 32], parent_block_hash=b"\\x02" * 32, token_ids=list(range(16)),
                    block_size=16, lora_id=None, medium="GPU", lora_name=None),
        BlockRemoved(block_hashes=[b"\\x03" * 32], medium="GPU"), AllBlocksCleared()])
    open(theirs, "wb").write(msgspec.msgpack.Encoder().encode(out))
""")


def main() -> int:
    anchors = os.environ.get("ANCHORS")
    if not anchors:
        print("set ANCHORS to the folder with vllm-venv (../shared/anchors/README.md)", file=sys.stderr)
        return 2
    events = [
        BlockStored([b"\x01" * 32, b"\x02" * 32], None, list(range(32)), 16, "CPU"),
        BlockRemoved([b"\x01" * 32], "CPU"),
        AllBlocksCleared(),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = os.path.join(tmp, "ours.bin"), os.path.join(tmp, "theirs.bin")
        with open(ours, "wb") as f:
            f.write(encode_batch(events, ts=1.5))
        subprocess.run([os.path.join(anchors, "vllm-venv", "bin", "python"), "-c", VLLM_SIDE, ours, theirs], check=True)
        with open(theirs, "rb") as f:
            ts, back = decode_batch(f.read())
    print("pagedllm read:", ts, back)
    ok = [type(e) for e in back] == [BlockStored, BlockRemoved, AllBlocksCleared] and back[0].block_size == 16
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
