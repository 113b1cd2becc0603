"""`shardlab prepare` on corpus shapes (docs/data.md): `python -m shardlab.data.bench_shapes
[--only NAME,...] [--jsonl-mib N] [--bpe-mib N] [--json results.json]`.

Each case prepares one generated corpus at --workers 1 and then 2, in this process one after
the other, and reports both times and their ratio from the same run (the machine's load moves
absolute figures; a ratio taken seconds apart moves less). Everything is generated into a
temporary directory (random words; nothing downloaded or shipped) and removed afterwards:
  many-small   20,000 text files of 4 KiB, bytes
  tree-1g      1 GiB in 1,600 text files, bytes
  tree-bpe     48 MiB (--bpe-mib) in 1,600 text files, a byte-level BPE of vocab 4096 trained here
  one-file     one 512 MiB text file, bytes
  jsonl        256 MiB of JSONL (--jsonl-mib), bytes; then the same file compressed with zstd (one
               stream, decompressed by prepare's parent and split for the workers: data/units.py)
  tables       (not run by default) the same rows (--tables-mib, default 64) as Parquet, a
               `datasets` save_to_disk folder (written with pyarrow as datasets writes it: Arrow
               stream batches of 1,000 rows) and CSV, then as .jsonl.bz2 and .jsonl.xz
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time

from shardlab.data.bench import WORDS, train_bpe, write_corpus


def _block(size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    out, n = [], 0
    while n < size:
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 20))) + "\n"
        out.append(line)
        n += len(line)
    return "".join(out).encode()[:size]


def write_tree(root: str, files: int, file_bytes: int) -> None:
    """`files` text files of `file_bytes` in 100 folders, each a different slice of one block."""
    block = _block(max(8 << 20, 2 * file_bytes), 7)
    for i in range(files):
        d = os.path.join(root, f"d{i % 100:03d}")
        os.makedirs(d, exist_ok=True)
        at = (i * 7919) % (len(block) - file_bytes)
        with open(os.path.join(d, f"f{i:05d}.txt"), "wb") as f:
            f.write(f"file {i}\n".encode() + block[at:at + file_bytes - 16])


def write_jsonl(path: str, size: int) -> None:
    rng = random.Random(3)
    block = _block(8 << 20, 5).decode()
    with open(path, "w") as f:
        n = 0
        while n < size:
            a = rng.randrange(len(block) - 4096)
            line = json.dumps({"id": n, "text": block[a:a + rng.randint(200, 4000)]}) + "\n"
            f.write(line)
            n += len(line)


def zstd_compress(src: str, dst: str) -> None:
    import zstandard

    with open(src, "rb") as fi, open(dst, "wb") as fo:
        zstandard.ZstdCompressor(level=3).copy_stream(fi, fo)


def timed_prepare(inputs: list[str], out: str, workers: int, tokenizer: str | None = None,
                  shard_mb: float = 64.0) -> float:
    from shardlab.data.prepare import prepare

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    prepare(inputs, out, tokenizer=tokenizer, workers=workers, val_fraction=0.0, progress=False, shard_mb=shard_mb)
    secs = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return secs


def _case(name: str, inputs: list[str], out: str, mib: float, tokenizer: str | None = None,
          shard_mb: float = 64.0) -> dict:
    one = timed_prepare(inputs, out, 1, tokenizer, shard_mb)
    two = timed_prepare(inputs, out, 2, tokenizer, shard_mb)
    row = {"input_mib": mib, "secs_1": one, "secs_2": two, "speedup_2_over_1": one / two,
           "mib_s_1": mib / one, "mib_s_2": mib / two, "load": os.getloadavg()[0]}
    print(f"{name}: {mib:.0f} MiB, 1 worker {one:.2f} s ({mib / one:.1f} MiB/s), 2 workers {two:.2f} s "
          f"({mib / two:.1f} MiB/s): 2 workers / 1 = {one / two:.2f}x (load {row['load']:.2f})", flush=True)
    return row


def tables_cases(tmp: str, mib: float, out: str) -> dict:
    """The `tables` case: the same rows in each shape (see the module docstring)."""
    import bz2
    import lzma

    import pyarrow as pa
    import pyarrow.parquet as pq

    src = os.path.join(tmp, "rows.jsonl")
    write_jsonl(src, int(mib * 2**20))
    with open(src) as f:
        table = pa.Table.from_pylist([json.loads(line) for line in f])
    pq.write_table(table, os.path.join(tmp, "rows.parquet"), row_group_size=10_000)
    ds = os.path.join(tmp, "rows-ds")
    os.makedirs(ds)
    with pa.ipc.new_stream(os.path.join(ds, "data-00000-of-00001.arrow"), table.schema) as w:
        w.write_table(table, max_chunksize=1000)
    for name, body in (("state.json", {"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}),
                       ("dataset_info.json", {})):
        with open(os.path.join(ds, name), "w") as f:
            json.dump(body, f)
    import pyarrow.csv as pcsv

    pcsv.write_csv(table, os.path.join(tmp, "rows.csv"))
    with open(src, "rb") as f:
        data = f.read()
    for kind, pack in (("bz2", bz2.compress), ("xz", lzma.compress)):
        with open(f"{src}.{kind}", "wb") as f:
            f.write(pack(data))
    shard_mb = min(64.0, mib / 16)
    rows = {name: _case(name, [os.path.join(tmp, name)], out, mib, shard_mb=shard_mb)
            for name in ("rows.parquet", "rows-ds", "rows.csv", "rows.jsonl.bz2", "rows.jsonl.xz")}
    for w in ("1", "2"):
        ratio = rows["rows-ds"][f"secs_{w}"] / rows["rows.parquet"][f"secs_{w}"]
        print(f"datasets folder / Parquet time at {w} worker(s): {ratio:.2f}x")
    # the CPU time of whole 1-worker prepares (in this process), alternating, median of 7: wall
    # times of sub-second prepares move with the machine's load and its fsyncs
    cpu: dict[str, list[float]] = {"rows.parquet": [], "rows-ds": []}
    for _ in range(7):
        for name, times in cpu.items():
            c0 = time.process_time()
            timed_prepare([os.path.join(tmp, name)], out, 1, shard_mb=shard_mb)
            times.append(time.process_time() - c0)
    med = {name: sorted(times)[3] for name, times in cpu.items()}
    rows["cpu_secs_1"] = med
    print(f"CPU time at 1 worker, median of 7: Parquet {med['rows.parquet']:.3f} s, datasets folder "
          f"{med['rows-ds']:.3f} s ({med['rows-ds'] / med['rows.parquet']:.2f}x)")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="many-small,tree-1g,tree-bpe,one-file,jsonl")
    p.add_argument("--bpe-mib", type=float, default=48, help="the tree-bpe case's size (default 48)")
    p.add_argument("--jsonl-mib", type=float, default=256, help="the jsonl case's size (default 256)")
    p.add_argument("--tables-mib", type=float, default=64, help="the tables case's size (default 64)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    only, rows = args.only.split(","), {}
    with tempfile.TemporaryDirectory(prefix="shardlab-shapes-") as tmp:
        out = os.path.join(tmp, "out")
        if "many-small" in only:
            write_tree(os.path.join(tmp, "many"), 20000, 4096)
            rows["many-small"] = _case("many-small", [os.path.join(tmp, "many")], out, 20000 * 4096 / 2**20)
            shutil.rmtree(os.path.join(tmp, "many"))
        if "tree-1g" in only:
            write_tree(os.path.join(tmp, "tree"), 1600, (1 << 30) // 1600)
            rows["tree-1g"] = _case("tree-1g", [os.path.join(tmp, "tree")], out, 1024)
            shutil.rmtree(os.path.join(tmp, "tree"))
        if "tree-bpe" in only:
            write_corpus(os.path.join(tmp, "sample.txt"), 8 << 20, seed=2)
            bpe = train_bpe(os.path.join(tmp, "sample.txt"), os.path.join(tmp, "bpe"))
            write_tree(os.path.join(tmp, "bpetree"), 1600, int(args.bpe_mib * 2**20) // 1600)
            rows["tree-bpe"] = _case("tree-bpe", [os.path.join(tmp, "bpetree")], out, args.bpe_mib, bpe)
        if "one-file" in only:
            write_corpus(os.path.join(tmp, "one.txt"), 512 << 20, seed=1)
            rows["one-file"] = _case("one-file", [os.path.join(tmp, "one.txt")], out, 512)
            os.remove(os.path.join(tmp, "one.txt"))
        if "jsonl" in only:
            src = os.path.join(tmp, "docs.jsonl")
            write_jsonl(src, int(args.jsonl_mib * 2**20))
            zstd_compress(src, src + ".zst")
            mib = os.path.getsize(src) / 2**20
            # units of a sixteenth of the file, as the plain file gets by default: at 256 MiB the
            # default --shard-mb gives the same units, and a small run splits the .zst too
            shard_mb = min(64.0, mib / 16)
            rows["jsonl"] = _case("jsonl", [src], out, mib, shard_mb=shard_mb)
            rows["jsonl.zst"] = _case("jsonl.zst", [src + ".zst"], out, mib, shard_mb=shard_mb)
            for w in ("1", "2"):
                rows[f"zst/plain speed, {w} worker(s)"] = rows["jsonl"][f"secs_{w}"] / rows["jsonl.zst"][f"secs_{w}"]
                print(f"jsonl.zst / jsonl speed at {w} worker(s): {rows[f'zst/plain speed, {w} worker(s)']:.2f}x")
        if "tables" in only:
            rows.update(tables_cases(tmp, args.tables_mib, out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
