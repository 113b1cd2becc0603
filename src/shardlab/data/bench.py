"""The data benchmark (docs/data.md): `python -m shardlab.data.bench [--sizes 2M,256M,2G]
[--prepare-mb 512] [--bpe-mb 24] [--repeats 3] [--json results.json]`.

Everything it reads it generates into a temporary directory first (random words; nothing is
downloaded or shipped), and removes afterwards:
  prepare    MiB/s of `shardlab prepare` at --workers 1 and 2, for bytes and for a byte-level
             BPE (vocab 4096) trained at bench time with `tokenizers` on the generated text;
             the figure is prepare's own (input bytes / seconds from start to manifest),
             so interpreter start-up is left out; medians of --repeats runs.
  train      for each corpus size: prepare it, then `shardlab train configs/gpt-tiny.yaml
             --nproc 2 data.source=tokens` for one step (wall time from launch to exit: the time
             to the first step, with start-up, checks, one step, a one-batch evaluation and exit)
             and for 20 steps (peak RSS per rank, the share of step time spent waiting for data).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SIZES = {"K": 2**10, "M": 2**20, "G": 2**30}
WORDS = ("the of and to in is that for it as with was on be by this are from or at an which not but had "
         "have one all were their there been has more when will would who so no can if out memory shard "
         "token rank batch gradient model data stream parallel reduce gather scatter optimizer").split()


def parse_size(text: str) -> int:
    return int(float(text[:-1]) * SIZES[text[-1].upper()]) if text[-1].upper() in SIZES else int(text)


def write_corpus(path: str, size: int, seed: int = 0) -> None:
    """`size` bytes of random words in lines, as one text file (a block of 8 MiB repeated with a
    numbered line before each copy, so writing 2 GiB takes seconds, not minutes)."""
    rng = random.Random(seed)
    lines, n = [], 0
    while n < min(size, 8 << 20):
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 20))) + "\n"
        lines.append(line)
        n += len(line)
    block = "".join(lines).encode()
    with open(path, "wb") as f:
        written, k = 0, 0
        while written < size:
            chunk = (f"copy {k}\n".encode() + block)[:size - written]
            f.write(chunk)
            written += len(chunk)
            k += 1


def train_bpe(corpus: str, out_dir: str, vocab: int = 4096) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    with open(corpus, encoding="utf-8") as f:
        sample = f.read(4 << 20).splitlines()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sample, trainer=trainer)
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    return out_dir


def run_prepare(corpus: str, out: str, workers: int, tokenizer: str | None = None, env: dict | None = None,
                shard_mb: float = 64) -> float:
    """One `shardlab prepare`; returns its own MiB/s figure."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "shardlab", "prepare", corpus, "--out", out, "--workers", str(workers),
           "--shard-mb", str(shard_mb)] + (["--tokenizer", tokenizer] if tokenizer else [])
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env={**os.environ, **(env or {})})
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return float(re.search(r"\(([\d.]+) MiB/s", res.stdout).group(1))


def bench_prepare(tmp: str, prepare_mb: float, bpe_mb: float, repeats: int) -> dict:
    corpus, bpe_corpus = os.path.join(tmp, "prepare.txt"), os.path.join(tmp, "prepare-bpe.txt")
    write_corpus(corpus, int(prepare_mb * 2**20), seed=1)
    write_corpus(bpe_corpus, int(bpe_mb * 2**20), seed=2)
    bpe = train_bpe(bpe_corpus, os.path.join(tmp, "bpe"))
    out = os.path.join(tmp, "prepared")
    rows = {}
    # shard size: 16 units or more on every corpus, so two workers have work to share
    cases = {"bytes": (corpus, None, {}, prepare_mb / 16), "bpe": (bpe_corpus, bpe, {}, bpe_mb / 16),
             "bpe-2threads": (bpe_corpus, bpe, {"RAYON_NUM_THREADS": "2"}, bpe_mb / 16)}
    for name, (src, tok, env, shard_mb) in cases.items():
        for workers in ((1,) if name == "bpe-2threads" else (1, 2)):
            runs = [run_prepare(src, out, workers, tok, env, shard_mb) for _ in range(repeats)]
            rows[f"{name} x{workers}"] = {"mib_s": statistics.median(runs), "runs": runs,
                                          "input_mib": prepare_mb if name == "bytes" else bpe_mb}
            print(f"prepare {name} workers={workers}: {statistics.median(runs):.1f} MiB/s {runs}", flush=True)
    for name in ("bytes", "bpe"):
        rows[f"{name} speedup x2"] = rows[f"{name} x2"]["mib_s"] / rows[f"{name} x1"]["mib_s"]
    return rows


def run_train(data: str, out: str, steps: int, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "shardlab", "train", "configs/gpt-tiny.yaml", "--nproc", "2",
           "data.source=tokens", f"data.path={data}", f"train.steps={steps}", "train.eval_batches=1",
           f"output.dir={out}", "output.run_name=run", "output.progress=false", "output.tensorboard=false",
           "output.trackers=[]",
           "checkpoint.resume=none", *extra]
    shutil.rmtree(os.path.join(out, "run"), ignore_errors=True)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    with open(os.path.join(out, "run", "metrics.json")) as f:
        m = json.load(f)
    return {"wall_s": wall, "peak_rss_mib": [b / 2**20 for b in m["peak_memory_bytes"]],
            "data_wait_fraction": m["data_wait_fraction"], "step_time_median_s": m["step_time_median_s"]}


def bench_train(tmp: str, sizes: list[str], repeats: int) -> dict:
    rows = {}
    for size in sizes:
        corpus, data = os.path.join(tmp, f"corpus-{size}.txt"), os.path.join(tmp, f"data-{size}")
        write_corpus(corpus, parse_size(size), seed=3)
        run_prepare(corpus, data, 2)
        os.remove(corpus)  # only the shards stay
        first = [run_train(data, tmp, 1) for _ in range(repeats)]
        longer = [run_train(data, tmp, 20) for _ in range(repeats)]
        workers1 = run_train(data, tmp, 20, "data.num_workers=1")
        rows[size] = {
            "first_step_wall_s": statistics.median(r["wall_s"] for r in first),
            "first_step_runs_s": [r["wall_s"] for r in first],
            "peak_rss_mib_per_rank": max(max(r["peak_rss_mib"]) for r in longer + first),
            "peak_rss_runs": [r["peak_rss_mib"] for r in longer],
            "data_wait_fraction": statistics.median(r["data_wait_fraction"] for r in longer),
            "data_wait_fraction_num_workers_1": workers1["data_wait_fraction"],
            "step_time_median_s": statistics.median(r["step_time_median_s"] for r in longer),
            "shard_bytes": sum(os.path.getsize(os.path.join(data, f)) for f in os.listdir(data)),
        }
        print(f"train {size}: {json.dumps(rows[size])}", flush=True)
        shutil.rmtree(data)
    base = rows[sizes[0]]
    for size in sizes[1:]:
        rows[size]["rss_over_smallest_mib"] = rows[size]["peak_rss_mib_per_rank"] - base["peak_rss_mib_per_rank"]
        rows[size]["start_ratio_to_smallest"] = rows[size]["first_step_wall_s"] / base["first_step_wall_s"]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m shardlab.data.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="2M,256M,2G", help="training corpora to generate (default 2M,256M,2G)")
    p.add_argument("--prepare-mb", type=float, default=512, help="bytes-tokenizer prepare corpus, MiB")
    p.add_argument("--bpe-mb", type=float, default=24, help="BPE prepare corpus, MiB")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--skip", choices=["prepare", "train"], default=None, help="leave one part out")
    p.add_argument("--tmp", default=None, help="where to generate (default: the system's temp dir)")
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="shardlab-data-bench-", dir=args.tmp)
    os.environ.setdefault("SHARDLAB_CACHE", os.path.join(tmp, "cache"))
    results: dict = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}
    try:
        if args.skip != "prepare":
            results["prepare"] = bench_prepare(tmp, args.prepare_mb, args.bpe_mb, args.repeats)
        if args.skip != "train":
            results["train"] = bench_train(tmp, args.sizes.split(","), args.repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
