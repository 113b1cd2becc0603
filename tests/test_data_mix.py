"""Weighted mixtures of prepared corpora (data.mix, data/mixture.py): each corpus's share tracks
its weight at every step, the order is a function of (seed, weights, step) alone, each corpus is
read in its own permuted epochs, and bad mixtures are one-line errors before any worker starts."""

from __future__ import annotations

import shutil
from fractions import Fraction

import pytest
import torch

from shardlab.config import ConfigError, load_config
from shardlab.data import build_datasets, make_sampler
from shardlab.data.mixture import apportion, normalised_weights
from shardlab.data.prepare import prepare
from shardlab.data.shards import DataError, read_manifest
from shardlab.data.tokens import check
from tests.test_prepare import DOCS, as_text_files, bpe_dir, words  # noqa: F401 (bpe_dir: a fixture)

G, T = 12, 16  # global batch, data.seq_len


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> tuple[str, str]:
    """Two byte-level corpora of different sizes (b repeats epochs long before a does), each with a val split."""
    tmp = tmp_path_factory.mktemp("mix")
    (tmp / "a").mkdir()
    (tmp / "b").mkdir()
    a = prepare([as_text_files(tmp / "a", DOCS)], str(tmp / "a-data"), val_fraction=0.2, progress=False)
    b = prepare([as_text_files(tmp / "b", [words(400 + 50 * i, 100 + i) for i in range(4)])], str(tmp / "b-data"),
                val_fraction=0.2, progress=False)
    return a, b


def mix_cfg(mix: dict, *extra: str):
    return load_config(None, ["data.source=tokens", "data.mix=" + repr(mix).replace("'", ""), f"data.seq_len={T}",
                              f"train.global_batch_size={G}", "train.micro_batch_size=2", *extra])


def test_shares_track_the_weights_at_every_step(corpora):
    a, b = corpora
    data = build_datasets(mix_cfg({a: 0.7, b: 0.3}))
    sampler = make_sampler(data, G, 0, True)
    tokens, samples = [0, 0], [0, 0]
    for step in range(1000):
        for i in sampler.global_indices(step).tolist():
            samples[data.train.source_of(i)] += 1
        tokens = [n * T for n in samples]
        # at every step boundary each corpus is within half a sample of its weight (two corpora)
        assert abs(samples[0] - 0.7 * G * (step + 1)) <= 0.5
    share = tokens[0] / sum(tokens)
    print(f"tokens per corpus over 1000 steps: {tokens}, share of a {share:.5f} (weight 0.7)")
    assert abs(share - 0.7) / 0.7 < 0.01 and abs(tokens[1] / sum(tokens) - 0.3) / 0.3 < 0.01
    assert samples == sampler.samples_before(1000)  # the closed form the run summary reports


def test_each_corpus_is_read_in_its_own_epochs(corpora):
    a, b = corpora
    data = build_datasets(mix_cfg({a: 0.7, b: 0.3}))
    sampler = make_sampler(data, G, 3, True)
    n_b, first_b = len(data.train.parts[1]), data.train.offsets[1]
    steps = next(s for s in range(1, 10_000) if sampler.samples_before(s)[1] >= n_b)
    seen = torch.cat([sampler.global_indices(s) for s in range(steps)])
    from_b = seen[seen >= first_b] - first_b
    counts = torch.bincount(from_b, minlength=n_b)
    # every window of b once in its first epoch; those of its second epoch so far a second time
    assert counts.min() >= 1 and counts.max() <= 2
    assert int((counts == 2).sum()) == sampler.samples_before(steps)[1] - n_b
    assert len(set(seen[seen < first_b].tolist())) == int((seen < first_b).sum())  # a: still in its first epoch


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_order_does_not_depend_on_the_world_size(corpora, world):
    a, b = corpora
    data = build_datasets(mix_cfg({a: 2, b: 1}))
    one = make_sampler(data, G, 5, True)
    again = make_sampler(data, G, 5, True)  # a new process (a resume) builds its own
    for step in (0, 1, 17, 250):
        parts = torch.cat([again.rank_indices(step, r, world) for r in range(world)])
        assert torch.equal(parts, one.global_indices(step))


def test_apportion_is_monotone_and_close_for_three_corpora():
    weights = normalised_weights({"x": 0.5, "y": 0.3, "z": 0.2})
    assert weights == [Fraction(1, 2), Fraction(3, 10), Fraction(1, 5)]  # exact: no float rounding
    prev = [0, 0, 0]
    for n in range(0, 5000, 7):
        now = apportion(n, weights)
        assert sum(now) == n and all(x >= p for x, p in zip(now, prev))
        assert all(abs(c - w * n) <= Fraction(3, 2) for c, w in zip(now, weights))
        prev = now


@pytest.mark.parametrize("mix,extra,fragment", [
    ("{A: 1}", ["data.path=/x"], "data.path (one corpus) or data.mix (a weighted mixture), not both"),
    (None, [], "needs data.path"),
    ("{A: 0.7, B: 0}", [], "data.mix[B]: weight 0.0 must be a number > 0"),
    ("{A: 0.7, B: -1}", [], "data.mix[B]: weight -1.0 must be a number > 0"),
    ("{}", [], "data.mix is empty"),
    ("{A: 1}", ["data.source=text"], "applies to data.source=tokens, not text"),
])
def test_bad_mixtures_are_one_line_config_errors(corpora, mix, extra, fragment):
    a, b = corpora
    over = ["data.source=tokens"] + ([f"data.mix={mix.replace('A', a).replace('B', b)}"] if mix else []) + extra
    with pytest.raises(ConfigError) as e:
        load_config(None, over)
    message = str(e.value).replace(a, "A").replace(b, "B")
    assert fragment in message and "\n" not in message


def test_bad_corpora_are_one_line_errors_before_workers(corpora, bpe_dir, tmp_path):  # noqa: F811
    a, b = corpora
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "x.txt").write_text("not prepared")
    cut = str(tmp_path / "cut")
    shutil.copytree(b, cut)
    shard = read_manifest(cut).split("train")["shards"][0]["bin"]["name"]
    with open(f"{cut}/{shard}", "r+b") as f:
        f.truncate(10)
    bpe = prepare([as_text_files(tmp_path, DOCS)], str(tmp_path / "bpe-data"), tokenizer=bpe_dir, progress=False)
    # (mixture, what the message says, the corpus it names)
    cases = [({a: 1, str(tmp_path / "raw"): 1}, "no manifest.json, so it is not a prepared corpus", "raw"),
             ({a: 1, cut: 1}, "bytes, but manifest.json says", cut),
             ({a: 1, bpe: 1}, "prepared with different tokenizers", bpe),
             ({a: 1, a + "/": 2}, "which are the same corpus", a + "/"),
             ({a: 1, b: 1}, "fewer than one global batch", "data.mix[" + a)]
    for i, (mix, fragment, named) in enumerate(cases):
        extra = ["train.global_batch_size=600"] if i == len(cases) - 1 else []
        with pytest.raises(DataError) as e:
            check(mix_cfg(mix, *extra, "model.vocab_size=512"))
        assert fragment in str(e.value) and named in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.parametrize("mixed", [False, True], ids=["one-corpus", "mixture"])
def test_what_a_step_trains_on_depends_on_seed_batch_and_step_only(corpora, mixed):
    """The windows of step s, read through the loop's loader by every rank of N and joined in rank
    order, are the same at N = 1..4 with any micro batch: a function of (seed, global batch, step),
    for the plain sampler over a prepared corpus (the token reader) and for a mixture."""
    from shardlab.data.loader import StepBatches

    a, b = corpora
    data = build_datasets(mix_cfg({a: 0.7, b: 0.3}) if mixed else
                          load_config(None, ["data.source=tokens", f"data.path={a}", f"data.seq_len={T}"]))
    steps = (0, 1, 7, 55, 120)  # past the first epoch of a (and of b's many)

    def step_windows(world: int, micro: int, seed: int = 5) -> dict[int, torch.Tensor]:
        out: dict[int, list[torch.Tensor]] = {s: [] for s in steps}
        for rank in range(world):  # each rank has its own sampler and loader, as a process would
            batches = StepBatches(data.train, make_sampler(data, G, seed, True), rank, world, micro, steps[-1] + 1,
                                  torch.device("cpu"))
            for s in steps:
                out[s] += [batches.next(s)[0] for _ in range(G // world // micro)]
        return {s: torch.cat(v) for s, v in out.items()}

    ref = step_windows(1, G)
    assert len(data.train) < steps[-1] * G  # the steps cross an epoch boundary
    for world, micro in ((2, 3), (3, 2), (4, 1), (3, 4)):
        got = step_windows(world, micro)
        assert all(torch.equal(got[s], ref[s]) for s in steps), (world, micro)
    assert not torch.equal(step_windows(1, G, seed=6)[0], ref[0])  # the seed does choose them


def test_validation_loss_per_corpus(corpora, tmp_path, capsys):
    """evaluate_sources gives each corpus of the mixture the loss of its own rows evaluated alone,
    the overall loss their token-weighted mean; a run reports both (the summary table too)."""
    from shardlab.loop import train as TR
    from shardlab.loop.evaluate import evaluate, evaluate_sources
    from shardlab.loop.run import build_run
    from shardlab.loop.run_summary import print_summary
    from shardlab.loop.runtime import Runtime

    a, b = corpora
    cfg = mix_cfg({a: 0.7, b: 0.3}, "model.preset=gpt-nano", "train.steps=1", "train.eval_batches=1",
                  "parallel.strategy=single", f"output.dir={tmp_path}", "output.run_name=r", "output.progress=false",
                  "output.tensorboard=false", "checkpoint.resume=none", "train.memory_tracking=none")
    rt = Runtime(0, 0, 1, torch.device("cpu"), None)
    run = build_run(cfg, rt)
    val = run.data.val
    got = evaluate_sources(run.model, val, cfg.train, rt)
    assert val.names == ["a-data", "b-data"] and set(got.by_source) == set(val.names)
    alone = [evaluate(run.model, part, cfg.train, rt) for part in val.parts]
    assert [got.by_source[n] for n in val.names] == alone  # the same rows in the same micro batches
    rows = [len(p) for p in val.parts]  # every target counts: T tokens a row
    assert got.loss == pytest.approx(sum(x * n for x, n in zip(alone, rows)) / sum(rows), rel=1e-12)
    assert got.loss == evaluate(run.model, val, cfg.train, rt)
    result = TR.train(cfg, rt)
    assert {k for k in result if k.startswith("val_loss/")} == {"val_loss/a-data", "val_loss/b-data"}
    assert [s["name"] for s in result["data_sources"]] == ["a-data", "b-data"]
    print_summary(result, str(tmp_path))
    table = capsys.readouterr().out
    assert "validation loss, a-data" in table and "validation loss, b-data" in table


def test_short_names_of_corpora():
    from shardlab.data.mixture import source_names

    assert source_names(["/d/web", "/d/code/"]) == ["web", "code"]
    assert source_names(["/x/a/web", "/y/b/web", "/z/code"]) == ["a/web", "b/web", "z/code"]
