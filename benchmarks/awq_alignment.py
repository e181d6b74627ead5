"""Mapped streaming from a checkpoint whose packed tensors are 32-byte aligned (what
``kvstream awq quantize`` writes) against the same checkpoint laid out as ``save_file``
writes it (the header unpadded, the data 8-byte aligned), in one process, decodes alternating.

    python benchmarks/awq_alignment.py [--folder AWQ_DIR] [--layers 96] [--rounds 8]

Two engines (``staging="mapped"``, K = 2, the native kernel) over the two files; each round
times one decode of 48 tokens at batch 1 after a 256-token prompt in each, per token. Prints
where each file's packed tensors start (modulo 64 bytes), the best and median ms per token,
and the aligned file's speed-up. Without ``--folder`` the synthetic model of
``awq_streaming.py`` is made in a temporary folder first.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import struct
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _util import scratch_dir  # noqa: E402

import torch  # noqa: E402

from kvstream.hf.awq.checkpoint import SafetensorsIndex  # noqa: E402
from kvstream.hf.awq.streaming import StreamingConfig  # noqa: E402


def as_save_file_writes_it(source: Path, target: Path) -> None:
    """A copy of the AWQ folder ``source`` whose safetensors header carries no padding."""
    shutil.copytree(source, target)
    path = target / "model.safetensors"
    with open(source / "model.safetensors", "rb") as f, open(path, "wb") as out:
        (size,) = struct.unpack("<Q", f.read(8))
        header = f.read(size).rstrip(b" ")
        header += b" " * (-(8 + len(header)) % 8)  # safetensors' own padding: 8 bytes
        out.write(struct.pack("<Q", len(header)) + header)
        shutil.copyfileobj(f, out, 16 * 2**20)


def offsets(folder: Path) -> dict[int, int]:
    """How many packed tensors start at each offset modulo 64 when mapped."""
    index = SafetensorsIndex(folder)
    return dict(Counter(index.mapped(name).data_ptr() % 64 for name in index.refs
                        if name.rsplit(".", 1)[1] in ("qweight", "qzeros", "scales")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", help="an AWQ checkpoint folder written by kvstream awq quantize (default: make the synthetic one)")
    parser.add_argument("--layers", type=int, default=96, help="layers of the synthetic model")
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(2)
    work = scratch_dir("kvstream-awq-alignment-")
    aligned = Path(args.folder) if args.folder else None
    if aligned is None:
        from awq_streaming import quantize, synthetic

        source = synthetic(work / f"synthetic-{args.layers}", args.layers)
        aligned = work / f"synthetic-{args.layers}-awq"
        quantize(str(source), aligned, False)  # RTN: random weights have no text to calibrate on
    unpadded = work / "as-save-file-writes-it"
    as_save_file_writes_it(aligned, unpadded)

    from kvstream.hf import HFEngine

    config = StreamingConfig("partial_resident", 2, 2, 2, staging="mapped")
    folders = {"aligned": aligned, "as save_file writes it": unpadded}
    engines = {name: HFEngine.from_pretrained(str(folder), device="cpu", dtype="float32", streaming=config,
                                              max_cache_bytes=256 * 2**20, max_batch_size=8)
               for name, folder in folders.items()}
    first = engines["aligned"]
    prompt = first.tokenizer.decode(first.encode(" ".join(f"word{i}" for i in range(400)))[:256])
    for engine in engines.values():  # faults the checkpoints in, caches the prompt
        engine.generate(prompt, max_new_tokens=4)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, engine in engines.items():
            result = engine.generate(prompt, max_new_tokens=48)
            times[name].append((result.total_ms - result.ttft_ms) / (len(result.token_ids) - 1))
    print(f"{aligned}: mapped K=2, {args.rounds} rounds of a 48-token decode at batch 1 (ms per token)")
    print(f"{'file':>22} {'packed tensors at (offset mod 64: count)':>42} {'best ms':>8} {'median ms':>10}")
    for name, values in times.items():
        print(f"{name:>22} {str(offsets(folders[name])):>42} {min(values):>8.1f} {statistics.median(values):>10.1f}")
    slow, fast = times["as save_file writes it"], times["aligned"]
    print(f"aligned speed-up: {min(slow) / min(fast):.2f}x best, {statistics.median(slow) / statistics.median(fast):.2f}x median")
    shutil.rmtree(unpadded)


if __name__ == "__main__":
    main()
